"""Two-pass classifier-free guidance (Wan, Qwen-Image): how the two passes run (``sampling.cfg_batching``).

Details: docs/modules.md, `digenrl.adapters.guidance`.
"""

from __future__ import annotations

import contextlib

import torch

from digenrl.adapters.cond import Cond

MODES = ("batched", "sequential")


class TwoPassCFG:
    """Mixin for an adapter with two-pass CFG. The family implements :meth:`timestep`,
    :meth:`pass_inputs`, :meth:`forward_pass` and :meth:`guide`; the mixin implements ``velocity``."""

    def uses_cfg(self) -> bool:
        return self.sampling.guidance > 1.0

    @property
    def cfg_batched(self) -> bool:
        """One forward of 2B; ``auto`` (not resolved by the memory model) runs sequential, as the
        families' own pipelines do."""
        return self.sampling.cfg_batching == "batched"

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The model's timestep input for sigmas (B,)."""
        raise NotImplementedError

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        """The batch-first conditioning tensors of one pass (same keys for both passes)."""
        raise NotImplementedError

    def forward_pass(
        self, latents: torch.Tensor, t: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One transformer forward over a batch, fp32 out."""
        raise NotImplementedError

    def guide(self, v_cond: torch.Tensor, v_unc: torch.Tensor) -> torch.Tensor:
        """The guided velocity from the two passes' outputs (in fp32)."""
        raise NotImplementedError

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        t = self.timestep(sigma)
        pos = self.pass_inputs(cond, negative=False)
        if not self.uses_cfg():
            return self.forward_pass(latents, t, pos)
        neg = self.pass_inputs(cond, negative=True)
        if self.cfg_batched:
            both = {k: torch.cat([pos[k], neg[k]]) for k in pos}
            v_cond, v_unc = self.forward_pass(torch.cat([latents, latents]), torch.cat([t, t]), both).chunk(2)
        else:  # the first output is kept across the second forward: a copy of it, since a compiled
            # forward with CUDA graphs (compile_mode reduce-overhead) returns a buffer its next replay
            # overwrites (``.float()`` copies nothing in fp32)
            v_cond = self.forward_pass(latents, t, pos).clone()
            v_unc = self.forward_pass(latents, t, neg)
        return self.guide(v_cond, v_unc)


def backward_through_velocity(adapter, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, objective):
    """Compute ``objective(v) -> (scalar, extras)`` on the guided velocity ``v`` at (latents, sigma) and
    backpropagate ``scalar`` into the transformer's parameters; returns ``extras``.

    Batched CFG or no CFG: one graph, one backward. Sequential CFG: one pass's graph at a time (module
    docstring); the same parameter gradient."""
    if not (isinstance(adapter, TwoPassCFG) and adapter.uses_cfg() and not adapter.cfg_batched):
        scalar, extras = objective(adapter.velocity(latents, sigma, cond))
        if scalar.requires_grad:  # else the step reached no trained weight (a frozen expert's step)
            scalar.backward()
        return extras
    t = adapter.timestep(sigma)
    neg = adapter.pass_inputs(cond, negative=True)
    rng = _rng_state(latents.device)  # the recomputed pass draws what the first one drew (LoRA dropout)
    with torch.no_grad():  # the unconditional output, no graph: its activations are not held
        v_unc = adapter.forward_pass(latents, t, neg)
    v_unc.requires_grad_(True)
    v_cond = adapter.forward_pass(latents, t, adapter.pass_inputs(cond, negative=False))
    scalar, extras = objective(adapter.guide(v_cond, v_unc))
    scalar.backward()  # through the conditional pass; its graph is freed, dL/dv_unc stays in v_unc.grad
    grad_unc = v_unc.grad
    if grad_unc is not None:  # the unconditional pass again, now with its graph, backpropagated alone
        with _replayed(latents.device, rng):
            v_again = adapter.forward_pass(latents, t, neg)
        if v_again.requires_grad:  # else a frozen expert ran the step: nothing of it trains
            v_again.backward(grad_unc)
    return extras


def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replayed(device: torch.device, state):
    """Run the block with the random state ``state`` (as torch.utils.checkpoint replays a recomputed
    forward), leaving the caller's random state as it was."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
