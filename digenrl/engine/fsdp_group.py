"""A sharded (FSDP2) trainer group's unit split: each rank trains an equal slice of a unit's
samples, so every rank runs the same forward / backward passes, and rank 0 reports the unit's
stats combined over the ranks (docs/distributed.md)."""

from __future__ import annotations

import dataclasses

import torch

from digenrl.units import Samples


def rank_slice(samples: Samples, rank: int, world: int) -> Samples:
    """Rank ``rank``'s equal share of a unit's samples (consecutive rows) for a sharded group."""
    n = len(samples)
    if n % world:
        raise RuntimeError(f"{n} samples do not split evenly over {world} FSDP ranks")
    rows = torch.arange(rank * n // world, (rank + 1) * n // world)
    return dataclasses.replace(
        samples, prompts=[samples.prompts[i] for i in rows.tolist()], cond=samples.cond.select(rows),
        latents=samples.latents[rows], log_probs=samples.log_probs[rows], train_idx=samples.train_idx[rows],
        rewards=samples.rewards[rows], reward_parts={k: v[rows] for k, v in samples.reward_parts.items()},
        advantages=samples.advantages[rows])


def combine_rank_stats(parts: list[dict]) -> dict:
    """One unit's stats from its ranks' shares (sums add; extremes combine)."""
    if len(parts) == 1:
        return parts[0]
    pick = {"ratio_max": max, "is_max": max, "ratio_min": min}
    return {k: pick.get(k, sum)(p[k] for p in parts) for k in parts[0]}
