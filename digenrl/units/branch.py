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
    groups, n, shape, dev = len(start), len(sigmas) - 1, tuple(start.shape[1:]), start.device
    # the whole tree's trajectory, allocated once: each segment is sampled into its nodes' rows (a
    # node's first leaf) and copied to the node's other leaves in place -- nothing is stacked at the end
    whole = Trajectory(
        torch.empty((groups * per_group, n + 1, *shape), device=dev),
        torch.zeros((groups * per_group, n), device=dev),
        sigmas,
        sde_mask,
        torch.empty((groups * per_group, n, *shape), device=dev),
    )

    def nodes(width: int, lo: int, hi: int) -> Trajectory:  # steps lo..hi of each node's first leaf
        def rows(t: torch.Tensor, extra: int) -> torch.Tensor:
            t = t.view(groups, width, per_group // width, *t.shape[1:])
            return t[:, :, 0, lo : hi + extra].view(groups * width, -1, *t.shape[4:])  # (a view: no copy)

        return Trajectory(
            rows(whole.latents, 1), rows(whole.log_probs, 0), sigmas, sde_mask, rows(whole.noise, 0)
        )

    def to_leaves(width: int, lo: int, hi: int) -> None:  # steps lo..hi-1 of each node to its leaves
        for t in (whole.latents, whole.log_probs, whole.noise):
            t = t.view(groups, width, per_group // width, *t.shape[1:])
            t[:, :, 1:, lo:hi] = t[:, :, :1, lo:hi]

    x, width = start, 1
    sample(
        adapter,
        node_cond(cond, groups, per_group, 1),
        x,
        sigmas[: k + 1],
        kind,
        eta,
        randn,
        sde_mask[:k],
        out=nodes(1, 0, k),
    )
    whole.log_probs[:, :k], whole.noise[:, :k] = 0.0, 0.0  # the prefix: deterministic, untrained
    to_leaves(1, 0, k)
    for (step, factor), end in zip(splits, ends):
        x = nodes(width, step, step).latents[:, 0]  # the nodes' state at the split, then each new node's
        x = x.reshape(groups, width, *shape).repeat_interleave(factor, 1).reshape(-1, *shape)
        width *= factor
        leaves = width == per_group
        sample(
            adapter,
            node_cond(cond, groups, per_group, width),
            x,
            sigmas[step : end + 1],
            kind,
            eta,
            randn if leaves else node_randn(width),
            sde_mask[step:end],
            None if batches is None or not leaves else batches[step:],
            out=nodes(width, step, end),
        )
        if not leaves:
            to_leaves(width, step, end)
    return whole


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
