"""The KL reference computed at rollout (``algorithm.kl_reference: rollout``): the sampler's
reference step means at each sample's trained steps, and the trainer's read of them.

Details: docs/modules.md, `digenrl.units.klref`.
"""

from __future__ import annotations

import torch

from digenrl.algorithms.sde import noise_std, step_mean


class RolloutReference:
    """Collects, while a unit is sampled, the reference step mean of every (sample, trained step):
    one no-grad forward under ``context`` (``Policy.reference``) per sampling forward batch that holds
    samples training the step, on those samples only. ``lockstep``: the steps a sharded group's ranks
    all run a reference forward at, on every forward batch (one with no sample training the step: on
    its first row, discarded), so their parameter gathers match (FSDP2; DanceGRPO's per-sample steps)."""

    def __init__(self, context, train_idx: torch.Tensor, kind: str, eta: float, lockstep=None):
        self.context, self.train_idx, self.kind, self.eta = context, train_idx.cpu(), kind, eta
        self.lockstep = None if lockstep is None else set(lockstep)
        self.means: torch.Tensor | None = None  # (B, T, *latent): by trained-step position
        self.forwards = 0  # reference forwards run

    def at_step(self, adapter, x: torch.Tensor, sigmas, i: int, cond, rows: torch.Tensor | None) -> None:
        """The reference step means at step ``i`` of the batch's rows ``rows`` (on the host; None: all)
        that train it. Which rows train it is read on the host: nothing here waits for the device."""
        idx = self.train_idx if rows is None else self.train_idx[rows]
        hit = idx == i  # (rows, positions): a sample trains a step at most once
        trains = hit.any(1)
        if not bool(trains.any()):
            if self.lockstep is not None and i in self.lockstep:  # the group's pass, on one row
                first = torch.zeros(1, dtype=torch.long) if rows is None else rows[:1]
                self._velocity(adapter, x, sigmas, i, cond, first.to(x.device), first)
            return
        local = trains.nonzero().squeeze(1)
        picked = local if rows is None else rows[local]
        if self.means is None:
            shape = (len(self.train_idx), self.train_idx.shape[1], *x.shape[1:])
            self.means = torch.zeros(shape, dtype=torch.float32, device=x.device)
        dev_rows = picked.to(x.device)
        xr, v = self._velocity(adapter, x, sigmas, i, cond, dev_rows, picked)
        std = noise_std(self.kind, sigmas, i, self.eta)  # the trainer's: the step's std, SDE or not
        mu = step_mean(self.kind, xr, v, float(sigmas[i]), float(sigmas[i + 1]), std)
        self.means[dev_rows, hit[local].float().argmax(1).to(x.device)] = mu

    def _velocity(self, adapter, x, sigmas, i, cond, rows, host_rows):
        """(x of ``rows``, the reference's velocity there): one forward under the reference
        (``host_rows``: ``rows`` on the CPU)."""
        xr, c = x[rows], cond.select(rows, host_rows)
        with torch.no_grad(), self.context():
            v = adapter.velocity(xr, adapter.sigma_input(sigmas[i].expand(len(xr))), c)
        self.forwards += 1
        return xr, v

    def result(self, latent_shape: tuple[int, ...]) -> torch.Tensor:
        """(B, T, *latent) fp32 on the CPU: what the samples carry (zeros where no step is trained)."""
        if self.means is None:
            return torch.zeros((len(self.train_idx), self.train_idx.shape[1], *latent_shape))
        return self.means.cpu()


def shipped_reference(samples, rows: torch.Tensor, i: int, device) -> torch.Tensor:
    """The reference step mean of ``rows`` at step ``i`` from the samples' ``ref_means`` (a row that
    does not train ``i`` -- a lockstep pass weighted 0 -- gets its first position's)."""
    pos = (samples.train_idx[rows] == i).float().argmax(1)
    return samples.ref_means[rows, pos].to(device)
