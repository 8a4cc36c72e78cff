"""GRPO-Guard (Wang et al. 2025, arXiv 2510.22319; Flow-Factory's ``grpo-guard``): Flow-GRPO with the
ratio normalised so that the clip regulates every timestep alike.

Details: docs/modules.md, `digenrl.algorithms.guard`.
"""

from __future__ import annotations

import torch

from digenrl.algorithms.grpo import clipped_ratio_objective


def normalised_log_ratio(
    logp: torch.Tensor, logp_old: torch.Tensor, mu: torch.Tensor, mu_old: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per sample: s (logp - logp_old) + mean((mu - mu_old)^2) / (2 s)."""
    mse = ((mu - mu_old).reshape(mu.shape[0], -1) ** 2).mean(dim=1)
    return scale * (logp - logp_old) + mse / (2 * scale)


def guard_objective(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    mu: torch.Tensor,
    mu_old: torch.Tensor,
    scale: float,
    clip_range: float,
) -> tuple[torch.Tensor, dict]:
    """PPO-clip on the normalised ratio; returns the per-term loss and detached stats."""
    ratio = torch.exp(normalised_log_ratio(logp, logp_old, mu, mu_old, scale))
    return clipped_ratio_objective(ratio, adv, clip_range)
