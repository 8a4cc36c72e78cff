"""Group-relative advantages over rolled-out units (docs/algorithms.md): one per sample, or, for a
branched group (``algorithm.branch_advantages: depth``), BranchGRPO's one per sample and step."""

from __future__ import annotations

import math

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
    widths = step_widths(cfg)
    chunks = [batches] if alg.std == "global" and widths is None else [[b] for b in batches]
    for chunk in chunks:
        total = torch.cat([b.rewards for b in chunk]).float()
        if rc.combine == "weighted_sum":
            adv = _advantages(total, alg, alg.adv_clip, widths)
        else:
            adv = 0.0
            for term in rc.components:
                adv = adv + term.weight * _component_advantages(chunk, term.name, total, alg, widths)
            adv = adv.clamp(-alg.adv_clip, alg.adv_clip)
        for b, a in zip(chunk, adv.split([len(b) for b in chunk])):
            b.advantages = a


def _component_advantages(chunk, name: str, total: torch.Tensor, alg, widths=None) -> torch.Tensor:
    """One component's own group advantage (unweighted, unclipped); samples whose total is NaN are
    left out of it (advantage 0)."""
    r = torch.cat([b.reward_parts[name] for b in chunk]).float().masked_fill(torch.isnan(total), float("nan"))
    return _advantages(r, alg, float("inf"), widths)


def _advantages(r: torch.Tensor, alg, clip: float, widths) -> torch.Tensor:
    if widths is None:
        return grpo.group_advantages(r, alg.group_size, alg.std, clip, ddof=alg.std_ddof)
    return depth_advantages(r, alg.group_size, widths).clamp(-clip, clip)


def step_widths(cfg) -> list[int] | None:
    """With ``algorithm.branch_advantages: depth``, the number of nodes per group each rollout step
    leads to (1 on the shared prefix; the branches' count from ``shared_prefix`` on, multiplied at each
    ``branch_tree`` split); else None (one advantage per sample)."""
    alg = cfg.algorithm
    if alg.branch_advantages != "depth":
        return None
    splits = [(alg.shared_prefix, alg.group_size // math.prod(f for _, f in alg.branch_tree))]
    splits += [tuple(t) for t in alg.branch_tree]
    widths, width = [], 1
    for step in range(cfg.sampling.steps):
        for at, factor in splits:
            width *= factor if at == step else 1
        widths.append(width)
    return widths


def depth_advantages(rewards: torch.Tensor, group_size: int, widths: list[int]) -> torch.Tensor:
    """BranchGRPO's advantages (Li et al. 2025; their ``compute_node_rewards_from_leaves`` and
    ``compute_hierarchical_advantages_by_depth``): (B,) leaf rewards -> (B, steps).

    Step t leads to one of ``widths[t]`` nodes of the group's tree (a node's leaves are contiguous
    rows). A node's reward is the mean of its leaves' (reward fusion); the nodes of one depth are
    normalised together, (R - mean) / (std + 1e-8) with the sample std, 0 where that std is below
    1e-6 or the depth holds one node; every leaf takes its node's advantage for that step. A leaf
    whose reward is NaN is left out of its node's mean and gets 0 at every step."""
    r = rewards.double().view(-1, group_size)  # (groups, G)
    out = torch.zeros(*r.shape, len(widths), dtype=torch.float64)
    for w in sorted(set(widths) - {1}):
        node = r.view(len(r), w, group_size // w).nanmean(dim=2)  # fused node rewards (groups, w)
        ok = ~torch.isnan(node)
        n = ok.sum(dim=1, keepdim=True)
        mean = torch.where(ok, node, 0.0).sum(dim=1, keepdim=True) / n.clamp(min=1)
        centred = torch.where(ok, node - mean, 0.0)
        std = (centred.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        adv = torch.where((std < 1e-6) | (n < 2), 0.0, centred / (std + 1e-8))
        leaf = adv.repeat_interleave(group_size // w, 1)  # every leaf takes its node's advantage
        out[:, :, [t for t, wt in enumerate(widths) if wt == w]] = leaf[..., None]
    out[torch.isnan(r)] = 0.0
    return out.float().reshape(len(rewards), len(widths))


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
