"""Group-relative advantages over rolled-out units (docs/algorithms.md)."""

from __future__ import annotations

import torch

from digenrl.algorithms import grpo
from digenrl.units.samples import Samples


def assign_advantages(batches: list[Samples], cfg) -> None:
    """Group-relative advantages; with global std, over all the given batches together.

    ``reward.combine: weighted_sum`` normalises the weighted total per group;
    ``per_reward_advantage`` (DanceGRPO / MixGRPO) normalises each component per group and sums
    the advantages with the components' weights, clipping the sum. A sample whose total is NaN
    (``nan_policy: drop``) gets advantage 0 and is left out of every group statistic.
    """
    alg, rc = cfg.algorithm, cfg.reward
    chunks = [batches] if alg.std == "global" else [[b] for b in batches]
    for chunk in chunks:
        total = torch.cat([b.rewards for b in chunk]).float()
        if rc.combine == "weighted_sum":
            adv = grpo.group_advantages(total, alg.group_size, alg.std, alg.adv_clip, ddof=alg.std_ddof)
        else:
            dropped = torch.isnan(total)
            adv = torch.zeros_like(total)
            for term in rc.components:
                r = (
                    torch.cat([b.reward_parts[term.name] for b in chunk])
                    .float()
                    .masked_fill(dropped, float("nan"))
                )
                adv += term.weight * grpo.group_advantages(
                    r, alg.group_size, alg.std, float("inf"), ddof=alg.std_ddof
                )
            adv = adv.clamp(-alg.adv_clip, alg.adv_clip)
        for b, a in zip(chunk, adv.split([len(b) for b in chunk])):
            b.advantages = a
