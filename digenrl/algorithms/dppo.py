"""Flow-DPPO (Ping et al. 2026, arXiv 2606.11025; veRL-Omni's ``flow_dppo``, UniRL's flowdppo):
Flow-GRPO with the ratio clip replaced by a divergence trust region.

Details: docs/modules.md, `digenrl.algorithms.dppo`.
"""

from __future__ import annotations

import torch


def step_kl(mu: torch.Tensor, mu_old: torch.Tensor, scale: float) -> torch.Tensor:
    """Per sample: the exact KL between two step Gaussians of equal scale, mean((mu - mu_old)^2) / (2 s^2)."""
    diff = (mu - mu_old).reshape(mu.shape[0], -1)
    return (diff**2).mean(dim=1) / (2 * max(scale, 1e-12) ** 2)


def trust_region_block(kl: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, delta: float):
    """True where a term leaves the trust region moving away from the behaviour policy."""
    away = ((adv > 0) & (ratio > 1)) | ((adv < 0) & (ratio < 1))
    return (kl >= delta) & away


def dppo_objective(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    mu: torch.Tensor,
    mu_old: torch.Tensor,
    scale: float,
    delta: float,
) -> tuple[torch.Tensor, dict]:
    """The per-term loss -A rho, zero where blocked (the mask is detached), and detached stats (0-dim
    tensors: read after the backward, nothing here waits for the device)."""
    ratio = torch.exp(logp - logp_old)
    with torch.no_grad():
        kl = step_kl(mu, mu_old, scale)
        block = trust_region_block(kl, ratio, adv, delta)
    loss = torch.where(block, torch.zeros_like(ratio), -adv * ratio)
    with torch.no_grad():
        stats = {
            "ratio_mean": ratio.mean(),
            "ratio_max": ratio.max(),
            "ratio_min": ratio.min(),
            "clip_frac": block.float().mean(),  # the masked fraction, reported as the clip's
            "step_kl_mean": kl.mean(),
        }
    return loss, stats
