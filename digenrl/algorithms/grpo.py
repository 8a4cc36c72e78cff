"""GRPO for flow models: group-relative advantages, the clipped objective, KL, trained timesteps."""

from __future__ import annotations

import math

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, std: str = "per_prompt", clip: float = 5.0,
                     eps: float = 1e-4) -> torch.Tensor:
    """A = (r - mean_prompt(r)) / (std + eps), clipped to +-clip.

    ``rewards`` is flat (num_groups * G,), grouped contiguously. ``std`` is the per-prompt std or the
    global std of the whole batch (Flow-GRPO's ``global_std``). Zero-variance groups give A = 0.
    NaN rewards (``reward.nan_policy: drop``) get A = 0 and are left out of every mean and std;
    a group with fewer than two scored samples gives A = 0.
    """
    r = rewards.float().view(-1, group_size)
    ok = ~torch.isnan(r)
    n = ok.sum(dim=1, keepdim=True)
    mean = torch.where(ok, r, 0.0).sum(dim=1, keepdim=True) / n.clamp(min=1)
    centered = torch.where(ok, r - mean, 0.0)
    if std == "per_prompt":
        scale = (centered.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    else:
        scored = r[ok]
        scale = scored.std() if scored.numel() > 1 else torch.zeros(())
    return (centered / (scale + eps)).clamp(-clip, clip).reshape(-1)


def clipped_objective(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, clip_range: float,
                      is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO-clip per element: max(-A rho, -A clip(rho, 1-e, 1+e)), rho = exp(logp - logp_old).

    ``logp_old`` is the behaviour log-prob (on-policy) or the proximal one (stale samples, decoupled
    PPO); ``is_weight`` = capped exp(logp_prox - logp_behaviour) multiplies the loss in that case.
    Returns the unreduced loss and detached stats.
    """
    ratio = torch.exp(logp - logp_old)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    if is_weight is not None:
        loss = loss * is_weight
    with torch.no_grad():
        stats = {
            "ratio_mean": ratio.mean().item(),
            "ratio_max": ratio.max().item(),
            "ratio_min": ratio.min().item(),
            "clip_frac": ((ratio - 1).abs() > clip_range).float().mean().item(),
        }
    return loss, stats


def kl_to_reference(mu: torch.Tensor, mu_ref: torch.Tensor, std: float) -> torch.Tensor:
    """Flow-GRPO's KL between the two step Gaussians: mean over non-batch dims of (mu - mu_ref)^2 / (2 std^2).

    (Normalisation: per-element mean, same reduction as the log-prob; std is the step's std_i.)
    """
    diff = (mu - mu_ref).reshape(mu.shape[0], -1)
    return (diff**2).mean(dim=1) / (2 * max(std, 1e-8) ** 2)


def select_timesteps(mode: str, num_steps: int, n_samples: int, generator: torch.Generator, *,
                     fraction: float = 0.99, window: int = 2, iteration: int = 0,
                     shift_every: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Which denoising steps are stochastic and which are trained.

    Returns ``sde_mask`` (N,) bool and ``train_idx`` (n_samples, T) long:
    - fraction (Flow-GRPO): all steps SDE; train steps 0..T-1, T = floor(N * fraction) (never the last).
    - random (DanceGRPO): all steps SDE; per sample, a random subset of floor(fraction * (N-1)) of the
      first N-1 steps (the last step is dropped).
    - window (Flow-GRPO-Fast / MixGRPO): only a window of ``window`` steps is SDE (ODE elsewhere) and
      trained; start random per call (shift_every = 0) or sliding by one every ``shift_every`` iterations.
    """
    sde_mask = torch.ones(num_steps, dtype=torch.bool)
    if mode == "fraction":
        t = max(1, min(num_steps - 1, math.floor(num_steps * fraction)))
        return sde_mask, torch.arange(t).repeat(n_samples, 1)
    if mode == "random":
        t = max(1, math.floor(fraction * (num_steps - 1)))
        idx = torch.stack([torch.randperm(num_steps - 1, generator=generator)[:t] for _ in range(n_samples)])
        return sde_mask, idx
    if mode == "window":
        w = min(window, num_steps - 1)
        span = num_steps - w  # valid starts: 0 .. N-1-w (never the last step)
        if shift_every:
            start = (iteration // shift_every) % span
        else:
            start = int(torch.randint(span, (1,), generator=generator))
        sde_mask = torch.zeros(num_steps, dtype=torch.bool)
        sde_mask[start : start + w] = True
        return sde_mask, torch.arange(start, start + w).repeat(n_samples, 1)
    raise ValueError(f"unknown timestep selection mode {mode!r}")
