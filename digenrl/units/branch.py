"""Shared-prefix group rollouts (``algorithm.shared_prefix: k``; BranchGRPO / DanceGRPO's shared
initial noise; docs/algorithms.md "Shared-prefix group rollouts").

A group's G samples start from one initial noise and take the deterministic (ODE) steps 0..k-1
together: those k forwards run once per group, on one row, and the group branches at step k into its
samples, each with its own SDE noise from there on. The saved work is (G - 1) x k forwards per group.
Everything after the branch is the plain sampler (:func:`digenrl.algorithms.sde.sample` on the tail of
the schedule), so the trajectory, its log-probs and its step noise have the unshared layout: steps
before k are ODE steps (log-prob 0, no noise, never trained).
"""

from __future__ import annotations

import torch

from digenrl.algorithms.sde import Trajectory, sample
from digenrl.units.rows import stream_seed


def prefix_noise(seed: int, iteration: int, group_ids: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """(groups, *shape): each group's one initial noise (its own stream, the same in every part unit)."""
    gens = [torch.Generator().manual_seed(stream_seed(seed, iteration, gid, "prefix")) for gid in group_ids]
    return torch.stack([torch.randn(shape, generator=g) for g in gens])


def branched_sample(
    adapter, cond, start: torch.Tensor, per_group: int, sigmas, kind, eta, randn, sde_mask, batches, k: int
) -> Trajectory:
    """Steps 0..k-1 on one row per group from ``start`` (groups, ...), then the group's ``per_group``
    branches for steps k..N-1 (``cond``: per_group rows per group, contiguous; ``batches``: the
    per-step forwards of all the rows, as :func:`sample` takes them)."""
    heads = torch.arange(len(start), device=start.device) * per_group
    prefix = sample(adapter, cond.select(heads), start, sigmas[: k + 1], kind, eta, randn, sde_mask[:k])
    branch_from = prefix.latents[:, -1].repeat_interleave(per_group, 0)
    tail = sample(
        adapter,
        cond,
        branch_from,
        sigmas[k:],
        kind,
        eta,
        randn,
        sde_mask[k:],
        None if batches is None else batches[k:],
    )
    b = len(branch_from)
    shared = prefix.latents[:, :-1].repeat_interleave(per_group, 0)  # x_0 .. x_{k-1}, the group's own
    zeros = torch.zeros(b, k, *branch_from.shape[1:], device=branch_from.device)
    return Trajectory(
        torch.cat([shared, tail.latents], 1),
        torch.cat([torch.zeros(b, k, device=branch_from.device), tail.log_probs], 1),
        sigmas,
        sde_mask,
        torch.cat([zeros, tail.noise], 1),
    )


def prefix_selection(sde_mask: torch.Tensor, train_idx: torch.Tensor, k: int):
    """The prefix's steps made deterministic and untrained: (sde_mask with steps < k off, train_idx
    without the positions < k; every row of it is the same in the modes a prefix allows)."""
    mask = sde_mask.clone()
    mask[:k] = False
    keep = train_idx[0] >= k
    return mask, train_idx[:, keep]
