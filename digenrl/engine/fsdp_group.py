"""A sharded (FSDP2) trainer group's unit split: each rank trains an equal share of a unit's
samples (of one mini-batch's samples, with mini-batch PPO), so every rank runs the same forward /
backward passes, and rank 0 reports the unit's stats combined over the ranks (docs/distributed.md)."""

from __future__ import annotations

import dataclasses

import torch

from digenrl.unit_rows import minibatch_rows
from digenrl.units import Samples


def shard_trainer_rank(policy, degree: int, resume: str | None = None):
    """Shard a trainer rank's policy (FSDP2 over groups of ``degree`` consecutive ranks of the group
    just joined -- HSDP when there are several: each replica group trains its own units, backward
    reduce-scatters inside it only, :func:`~digenrl.distributed.fsdp.all_reduce_replicas` sums over the
    replicas at the step; activation checkpointing, if on, is already applied by ``Policy``), then
    restore a resumed run's optimizer state (checkpoint ``resume``) into the shards: a ``dcp/``
    checkpoint resharded (each rank reads its own shards, by path), or an unsharded run's
    ``optimizer.pt`` split. Returns the device mesh."""
    from pathlib import Path

    from digenrl.checkpoint import find_checkpoint, read_state, restore_optimizer
    from digenrl.distributed import fsdp

    mesh = fsdp.trainer_mesh(degree, policy.device.type)
    fsdp.shard_policy(policy, mesh, independent_replicas=True)
    if resume is not None:
        restore_optimizer(read_state(find_checkpoint(Path(resume))), policy)
    return mesh


def rank_slice(
    samples: Samples,
    rank: int,
    world: int,
    minibatch: int = 0,
    minibatches: int = 1,
    group_size: int | None = None,
) -> Samples:
    """Rank ``rank``'s equal share (consecutive rows) of the unit's samples of mini-batch
    ``minibatch`` (:func:`~digenrl.unit_rows.minibatch_rows`; all of them with one mini-batch). Train it
    as a whole: ``train_unit(..., minibatch=0, minibatches=1)``."""
    n = len(samples)
    rows = torch.arange(n)
    if minibatches > 1:
        rows = minibatch_rows(
            n, group_size, minibatch, minibatches, n // len(samples.group_ids), samples.first_sample
        )
    if len(rows) % world:
        raise RuntimeError(f"{len(rows)} samples do not split evenly over {world} FSDP ranks")
    share = len(rows) // world
    return select_rows(samples, rows[rank * share : (rank + 1) * share])


def train_share(policy, samples: Samples, unit, rank: int, degree: int, total_terms: int) -> dict:
    """Rank ``rank`` of a shard group of ``degree`` trains its share (:func:`rank_slice`) of train unit
    ``unit`` (its mini-batch ``unit.step``); returns the share's stats."""
    from digenrl.units import train_unit

    cfg = policy.cfg
    mine = rank_slice(samples, rank, degree, unit.step, cfg.train.optimizer_steps, cfg.algorithm.group_size)
    return train_unit(policy, mine, total_terms, unit.tsp_rank, unit.tsp_degree)


def select_rows(samples: Samples, rows: torch.Tensor) -> Samples:
    """The unit's samples ``rows`` (same iteration, version and groups; per-sample fields cut)."""
    return dataclasses.replace(
        samples,
        prompts=[samples.prompts[i] for i in rows.tolist()],
        cond=samples.cond.select(rows),
        latents=samples.latents[rows],
        log_probs=samples.log_probs[rows],
        train_idx=samples.train_idx[rows],
        rewards=samples.rewards[rows],
        reward_parts={k: v[rows] for k, v in samples.reward_parts.items()},
        advantages=samples.advantages[rows],
        noise_seeds=None if samples.noise_seeds is None else samples.noise_seeds[rows],
        step_noise=None if samples.step_noise is None else samples.step_noise[rows],
    )


def reshard(model) -> None:
    """Free every gathered (unsharded) parameter copy of an FSDP2 model. A forward without a backward
    (sampling) leaves the root's gathered (``reshard_after_forward=False``), and the next forward would
    reuse that copy even after the shards changed (an EMA swapped out, say)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def combine_rank_stats(parts: list[dict]) -> dict:
    """One unit's stats from its ranks' shares (sums add; extremes combine)."""
    if len(parts) == 1:
        return parts[0]
    pick = {"ratio_max": max, "is_max": max, "ratio_min": min}
    return {k: pick.get(k, sum)(p[k] for p in parts) for k in parts[0]}
