"""GRPO-Guard (Wang et al. 2025, arXiv 2510.22319; Flow-Factory's ``grpo-guard``): Flow-GRPO with the
ratio normalised so that the clip regulates every timestep alike.

With the behaviour step x' = mu_old + s eps (s = std_i sqrt(-d)), the raw log-ratio is

    logp - logp_old = -mean(mu - mu_old)^2 / (2 s^2)  +  mean((mu - mu_old) eps) / s

Its first term is a negative drift (the mean of the ratio sits left of 1 once the policy moves) and
the 1/s factor makes its spread depend on the step, so one clip range is too wide at some steps and
too tight at others. Guard multiplies the log-ratio by s and adds the drift back:

    log rho_guard = s (logp - logp_old) + mean(mu - mu_old)^2 / (2 s)  =  mean((mu - mu_old) eps)

(mu - mu_old keeps its gradient), then applies the usual clip: L = max(-A rho_g, -A clip(rho_g, 1 +- e)).
The factor s also re-weights each step's gradient by its noise scale (the paper's gradient re-weighting).
"""

from __future__ import annotations

import torch


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
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))
    with torch.no_grad():
        stats = {
            "ratio_mean": ratio.mean().item(),
            "ratio_max": ratio.max().item(),
            "ratio_min": ratio.min().item(),
            "clip_frac": ((ratio - 1).abs() > clip_range).float().mean().item(),
        }
    return loss, stats
