"""Online Diffusion-DPO (Wallace et al. 2023, arXiv 2311.12908; online as in Flow-Factory's ``dpo``,
flow_grpo and veRL-Omni): each prompt group's best and worst sample form a preference pair.

Details: docs/modules.md, `digenrl.algorithms.dpo`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def best_worst_pairs(rewards: torch.Tensor, groups: torch.Tensor) -> list[tuple[int, int]]:
    """(chosen, rejected) row indices per group id in ``groups``: its highest and lowest reward (the
    first of ties); none for a group whose scored rewards are all equal or that has one scored row."""
    pairs = []
    for g in groups.unique(sorted=True).tolist():
        rows = ((groups == g) & ~torch.isnan(rewards)).nonzero().squeeze(1)
        if len(rows) < 2:
            continue
        r = rewards[rows]
        hi, lo = int(r.argmax()), int(r.argmin())
        if r[hi] > r[lo]:
            pairs.append((int(rows[hi]), int(rows[lo])))
    return pairs


def dpo_loss(
    err_w: torch.Tensor, err_w_ref: torch.Tensor, err_l: torch.Tensor, err_l_ref: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-pair loss -log sigmoid(-beta Delta), the detached Delta); the reference errors carry no
    gradient."""
    delta = (err_w - err_w_ref.detach()) - (err_l - err_l_ref.detach())
    return -F.logsigmoid(-beta * delta), delta.detach()
