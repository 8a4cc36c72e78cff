"""Shared-prefix group rollouts (``algorithm.shared_prefix: k``; BranchGRPO / DanceGRPO's shared
initial noise; docs/algorithms.md "Shared-prefix group rollouts").

Details: docs/modules.md, `digenrl.units.branch`.
"""

from __future__ import annotations

import math

import torch

from digenrl.algorithms.sde import Trajectory, sample
from digenrl.units.rows import stream_seed
from digenrl.units.samples import GroupRNG


def prefix_noise(seed: int, iteration: int, group_ids: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """(groups, *shape): each group's one initial noise (its own stream, the same in every part unit)."""
    gens = [torch.Generator().manual_seed(stream_seed(seed, iteration, gid, "prefix")) for gid in group_ids]
    return torch.stack([torch.randn(shape, generator=g) for g in gens])


def branched_sample(
    adapter,
    cond,
    start: torch.Tensor,
    per_group: int,
    sigmas,
    kind,
    eta,
    randn,
    sde_mask,
    batches,
    k: int,
    tree: list[tuple[int, int]] = (),
    node_randn=None,
) -> Trajectory:
    """Steps 0..k-1 on one row per group from ``start`` (groups, ...), then the group's ``per_group``
    branches for steps k..N-1 (``cond``: per_group rows per group, contiguous; ``batches``: the
    per-step forwards of all the rows, as :func:`sample` takes them). ``tree``: later splits
    (step, factor): at k the group splits into per_group / prod(factors) nodes, each of which splits
    again at every later step; a node's steps run once, on the row of its first leaf, with
    ``node_randn(width)`` (a draw of ``width`` rows per group) for its SDE noise."""
    splits = [(k, per_group // math.prod(f for _, f in tree)), *tree]
    ends = [step for step, _ in splits[1:]] + [len(sigmas) - 1]
    groups = len(start)

    def expand(t: torch.Tensor, width: int) -> torch.Tensor:  # a node's rows copied to its leaves
        return t.repeat_interleave(per_group // width, 0)

    prefix = sample(
        adapter, node_cond(cond, groups, per_group, 1), start, sigmas[: k + 1], kind, eta, randn, sde_mask[:k]
    )
    lat, lps, noises = [expand(prefix.latents[:, :-1], 1)], [], []
    x, width = prefix.latents[:, -1], 1
    for (step, factor), end in zip(splits, ends):
        x = x.reshape(groups, width, *x.shape[1:]).repeat_interleave(factor, 1).reshape(-1, *x.shape[1:])
        width *= factor
        leaves = width == per_group
        seg = sample(
            adapter,
            node_cond(cond, groups, per_group, width),
            x,
            sigmas[step : end + 1],
            kind,
            eta,
            randn if leaves else node_randn(width),
            sde_mask[step:end],
            None if batches is None or not leaves else batches[step:],
        )
        lat.append(expand(seg.latents[:, :-1], width))
        lps.append(expand(seg.log_probs, width))
        noises.append(expand(seg.noise, width))
        x = seg.latents[:, -1]
    lat.append(x[:, None])
    b, dev = groups * per_group, x.device
    lps.insert(0, torch.zeros(b, k, device=dev))
    noises.insert(0, torch.zeros(b, k, *x.shape[1:], device=dev))
    return Trajectory(torch.cat(lat, 1), torch.cat(lps, 1), sigmas, sde_mask, torch.cat(noises, 1))


def node_rng(seed: int, iteration: int, group_ids: list[int]):
    """``width -> randn(shape)``: the SDE noise of a tree's inner nodes, ``width`` rows per group from
    each group's own stream for that width."""

    def of_width(width: int) -> GroupRNG:
        return GroupRNG([stream_seed(seed, iteration, gid, "nodes", width) for gid in group_ids], width)

    return of_width


def node_cond(cond, groups: int, per_group: int, width: int):
    """The conditioning of each of ``width`` nodes per group: its first leaf's row."""
    if width == per_group:
        return cond
    step = per_group // width
    return cond.select(
        (torch.arange(groups)[:, None] * per_group + torch.arange(width)[None, :] * step).reshape(-1)
    )


def prefix_selection(sde_mask: torch.Tensor, train_idx: torch.Tensor, k: int):
    """The prefix's steps made deterministic and untrained: (sde_mask with steps < k off, train_idx
    without the positions < k; every row of it is the same in the modes a prefix allows)."""
    mask = sde_mask.clone()
    mask[:k] = False
    keep = train_idx[0] >= k
    return mask, train_idx[:, keep]
