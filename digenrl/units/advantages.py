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
            adv = torch.zeros_like(total)
            for term in rc.components:
                adv += term.weight * _component_advantages(chunk, term.name, total, alg)
            adv = adv.clamp(-alg.adv_clip, alg.adv_clip)
        for b, a in zip(chunk, adv.split([len(b) for b in chunk])):
            b.advantages = a


def _component_advantages(chunk, name: str, total: torch.Tensor, alg) -> torch.Tensor:
    """One component's own group advantage (unweighted, unclipped); samples whose total is NaN are
    left out of it (advantage 0)."""
    r = torch.cat([b.reward_parts[name] for b in chunk]).float().masked_fill(torch.isnan(total), float("nan"))
    return grpo.group_advantages(r, alg.group_size, alg.std, float("inf"), ddof=alg.std_ddof)


def advantage_metrics(batches, cfg) -> dict[str, float]:
    """Per-component advantage statistics of an iteration's batches, for ``metrics.jsonl``:

    - ``adv/<name>``: mean over scored samples of |w_k A_k|, A_k the component's own group advantage
      (what ``per_reward_advantage`` adds up; with ``weighted_sum`` what it would): its pull on the update;
    - ``adv_groups/<name>``: the share of groups in which the component tells samples apart (its
      scored rewards not all equal); 0 = it gives no signal (e.g. OCR of images that show no text).
    """
    alg, rc = cfg.algorithm, cfg.reward
    chunks = [batches] if alg.std == "global" else [[b] for b in batches]
    totals = [torch.cat([b.rewards for b in chunk]).float() for chunk in chunks]
    scored = ~torch.isnan(torch.cat(totals))
    row = {}
    for term in rc.components:
        a = torch.cat([_component_advantages(c, term.name, t, alg) for c, t in zip(chunks, totals)])
        r = torch.cat([b.reward_parts[term.name] for b in batches]).float()
        r = r.masked_fill(~scored, float("nan")).view(-1, alg.group_size)
        hi, lo = r.nan_to_num(-torch.inf).amax(dim=1), r.nan_to_num(torch.inf).amin(dim=1)
        row[f"adv/{term.name}"] = (term.weight * a[scored]).abs().mean().item() if scored.any() else 0.0
        row[f"adv_groups/{term.name}"] = (hi > lo).float().mean().item()
    return row
