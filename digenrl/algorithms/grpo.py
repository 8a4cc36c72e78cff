"""GRPO for flow models: group-relative advantages, the clipped objective, KL, trained timesteps.

The math in words, with the reasons for each choice: docs/algorithms.md.
"""

from __future__ import annotations

import math

import torch

#: PPO clip range by SDE kind when ``algorithm.clip_range`` is unset: CPS's log-prob has no
#: 1/(2 std^2), so its ratios move on a different scale; flow_grpo pairs it with 1e-5.
CLIP_RANGE_BY_SDE = {"flow_grpo": 1e-4, "dance_grpo": 1e-4, "cps": 1e-5}


def default_clip_range(sde_kind: str) -> float:
    return CLIP_RANGE_BY_SDE[sde_kind]


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    std: str = "per_prompt",
    clip: float = 5.0,
    eps: float = 1e-4,
    ddof: int = 0,
) -> torch.Tensor:
    """A = (r - mean_prompt(r)) / (std + eps), clipped to +-clip (docs/algorithms.md, "Group advantages").

    ``rewards`` is flat (num_groups * G,), grouped contiguously. ``std`` is the per-prompt std or the
    global std of the whole batch (Flow-GRPO's ``global_std``); ``ddof`` 0 is the population std
    (flow_grpo), 1 the sample std (DanceGRPO). Computed in float64; a group whose scored rewards are
    all equal gets A = 0 exactly (in fp32 its mean leaves a residue that the tiny std would blow up).
    NaN rewards (``reward.nan_policy: drop``) get A = 0 and are left out of every mean and std;
    a group with fewer than two scored samples gives A = 0. Returns float32.
    """
    r = rewards.double().view(-1, group_size)
    ok = ~torch.isnan(r)
    n = ok.sum(dim=1, keepdim=True)
    mean = torch.where(ok, r, 0.0).sum(dim=1, keepdim=True) / n.clamp(min=1)
    centered = torch.where(ok & ~_flat_groups(r, ok), r - mean, 0.0)
    if std == "per_prompt":
        scale = (centered.square().sum(dim=1, keepdim=True) / (n - ddof).clamp(min=1)).sqrt()
    else:
        scored = r[ok]
        scale = scored.std(correction=ddof) if scored.numel() > 1 else torch.zeros((), dtype=r.dtype)
    return (centered / (scale + eps)).clamp(-clip, clip).float().reshape(-1)


def _flat_groups(r: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """(groups, 1) True where every scored reward of the group is equal (or fewer than two are scored)."""
    hi = torch.where(ok, r, -math.inf).amax(dim=1, keepdim=True)
    lo = torch.where(ok, r, math.inf).amin(dim=1, keepdim=True)
    return (hi == lo) | (ok.sum(dim=1, keepdim=True) < 2)


def clipped_objective(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    clip_range: float,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """PPO-clip per element: max(-A rho, -A clip(rho, 1-e, 1+e)), rho = exp(logp - logp_old).

    ``logp_old`` is the behaviour log-prob (on-policy) or the proximal one (stale samples, decoupled
    PPO); ``is_weight`` = capped exp(logp_prox - logp_behaviour) multiplies the loss in that case.
    Returns the unreduced loss and detached stats.
    """
    return clipped_ratio_objective(torch.exp(logp - logp_old), adv, clip_range, is_weight)


def clipped_ratio_objective(
    ratio: torch.Tensor, adv: torch.Tensor, clip_range: float, is_weight: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict]:
    """PPO-clip of a given ratio (Flow-GRPO's, or GRPO-Guard's normalised one): the unreduced loss and
    detached stats (0-dim tensors: read after the backward, nothing here waits for the device)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    if is_weight is not None:
        loss = loss * is_weight
    with torch.no_grad():
        stats = {
            "ratio_mean": ratio.mean(),
            "ratio_max": ratio.max(),
            "ratio_min": ratio.min(),
            "clip_frac": ((ratio - 1).abs() > clip_range).float().mean(),
        }
    return loss, stats


def kl_to_reference(mu: torch.Tensor, mu_ref: torch.Tensor, std: float) -> torch.Tensor:
    """Flow-GRPO's KL between the two step Gaussians: mean over non-batch dims of (mu - mu_ref)^2 / (2 std^2).

    (Normalisation: per-element mean, same reduction as the log-prob; std is the step's std_i.)
    """
    diff = (mu - mu_ref).reshape(mu.shape[0], -1)
    return (diff**2).mean(dim=1) / (2 * max(std, 1e-8) ** 2)


def window_bounds(
    num_steps: int, window: int, window_range: tuple[float, float]
) -> tuple[int, int, int] | None:
    """(first start, number of starts, width) of an SDE window inside ``window_range``, or None if it cannot
    fit.

    The range [a, b) in fractions of the N steps covers steps floor(a N) .. floor(b N) - 1, never the
    last step N-1; the window's width is min(window, N-1). (0, 0.5) gives flow_grpo-Fast's
    ``randint(0, N//2 - w)`` starts.
    """
    w = min(window, num_steps - 1)
    lo = math.floor(window_range[0] * num_steps + 1e-9)
    hi = min(math.floor(window_range[1] * num_steps + 1e-9), num_steps - 1)
    if hi - lo < w:
        return None
    return lo, hi - lo - w + 1, w


def select_timesteps(
    mode: str,
    num_steps: int,
    n_samples: int,
    generator: torch.Generator,
    *,
    fraction: float = 0.99,
    window: int = 2,
    iteration: int = 0,
    shift_every: int = 0,
    window_range: tuple[float, float] = (0.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which denoising steps are stochastic and which are trained.

    Returns ``sde_mask`` (N,) bool and ``train_idx`` (n_samples, T) long:
    - fraction (Flow-GRPO): all steps SDE; train steps 0..T-1, T = floor(N * fraction) (never the last).
    - random (DanceGRPO): all steps SDE; per sample, a random subset of floor(fraction * (N-1)) of the
      first N-1 steps (the last step is dropped).
    - window (Flow-GRPO-Fast / MixGRPO): only a window of ``window`` steps is SDE (ODE elsewhere) and
      trained, inside ``window_range`` (:func:`window_bounds`); start random per call (shift_every = 0)
      or sliding by one every ``shift_every`` iterations, wrapping around within the range.
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
        bounds = window_bounds(num_steps, window, window_range)
        if bounds is None:
            raise ValueError(
                f"window_range {window_range} of {num_steps} steps cannot hold a window of {window}"
            )
        first, n_starts, w = bounds
        if shift_every:
            start = first + (iteration // shift_every) % n_starts
        else:
            start = first + int(torch.randint(n_starts, (1,), generator=generator))
        sde_mask = torch.zeros(num_steps, dtype=torch.bool)
        sde_mask[start : start + w] = True
        return sde_mask, torch.arange(start, start + w).repeat(n_samples, 1)
    raise ValueError(f"unknown timestep selection mode {mode!r}")
