"""SDE sampling with log-probabilities (Flow-GRPO / DanceGRPO / CPS), all in fp32.

Notation (docs/algorithms.md): sigmas s_0 = 1 > ... > s_N = 0; step i goes s_i -> s_{i+1},
d = s_{i+1} - s_i < 0; v = model velocity at (x, s_i); eta = noise level.
The log-prob of a transition is the Gaussian log-density reduced by a MEAN over every non-batch
dim (not a sum) -- this is why Flow-GRPO's clip range is ~1e-4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def noise_std(kind: str, sigmas: torch.Tensor, i: int, eta: float) -> float:
    """Per-step noise scale std_i of the SDE (multiplied by sqrt(-d) when sampling)."""
    s = float(sigmas[i])
    if kind == "flow_grpo":
        # eta * sqrt(s / (1 - s)); at s = 1 the denominator uses s_1 instead
        denom = 1 - (float(sigmas[1]) if s >= 1.0 else s)
        return eta * math.sqrt(s / denom)
    if kind == "dance_grpo":
        return eta
    if kind == "cps":
        # coefficients-preserving sampling: std = s_{i+1} * sin(eta * pi / 2) (not scaled by sqrt(-d))
        return float(sigmas[i + 1]) * math.sin(eta * math.pi / 2)
    raise ValueError(f"unknown SDE kind {kind!r}")


def _mean_over_sample(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)


def step_mean(
    kind: str, x: torch.Tensor, v: torch.Tensor, s: float, s_next: float, std: float
) -> torch.Tensor:
    """Mean mu of x_{i+1} given x_i (and the model's v)."""
    d = s_next - s
    if kind == "cps":
        x0 = x - s * v  # predicted clean sample
        x1 = x + (1 - s) * v  # predicted noise
        return (1 - s_next) * x0 + math.sqrt(max(s_next**2 - std**2, 0.0)) * x1
    if std == 0.0:  # deterministic Euler step: exactly FlowMatchEulerDiscreteScheduler.step
        return x + d * v
    return x + d * (v + std**2 / (2 * s) * (x + (1 - s) * v))


def step_scale(kind: str, s: float, s_next: float, std: float) -> float:
    """Standard deviation of the transition noise: std * sqrt(-d) (CPS: std itself)."""
    return std if kind == "cps" else std * math.sqrt(s - s_next)


def transition_logprob(kind: str, x_next: torch.Tensor, mu: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-sample log-prob of x_next ~ N(mu, scale^2), MEAN over non-batch dims. CPS: -mean((x'-mu)^2)."""
    if kind == "cps":
        return -_mean_over_sample((x_next - mu) ** 2)
    return _mean_over_sample(-((x_next - mu) ** 2) / (2 * scale**2) - math.log(scale) - LOG_SQRT_2PI)


def sde_step(kind, x, v, sigmas, i, eta, noise):
    """One SDE step: returns (x_next, log_prob, mu). ``noise`` ~ N(0, I), or None for the ODE step."""
    s, s_next = float(sigmas[i]), float(sigmas[i + 1])
    std = noise_std(kind, sigmas, i, eta) if noise is not None else 0.0
    mu = step_mean(kind, x, v, s, s_next, std)
    if noise is None or std == 0.0:
        return mu, torch.zeros(x.shape[0], device=x.device), mu
    scale = step_scale(kind, s, s_next, std)
    x_next = mu + scale * noise
    return x_next, transition_logprob(kind, x_next, mu, scale), mu


@dataclass
class Trajectory:
    latents: torch.Tensor  # (B, N+1, *latent) fp32: x_0 (noise) ... x_N (sample)
    log_probs: torch.Tensor  # (B, N) fp32: log-prob of each recorded transition (0 on ODE steps)
    sigmas: torch.Tensor  # (N+1,)
    sde_mask: torch.Tensor  # (N,) bool: which steps were stochastic
    noise: torch.Tensor | None = (
        None  # (B, N, *latent): x_{i+1} - mu_i, each step's drawn noise (0 on ODE steps)
    )


@torch.no_grad()
def sample(
    adapter,
    cond,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    kind: str,
    eta: float,
    randn=None,
    sde_mask: torch.Tensor | None = None,
    batches: list[list[torch.Tensor]] | None = None,
    reference=None,
    out: Trajectory | None = None,
) -> Trajectory:
    """Run the step loop, recording every latent and transition log-prob (eta = 0: pure ODE).

    ``randn(shape)`` draws the per-step N(0, I) noise for the whole batch (a torch.Generator works too).
    ``batches[i]``: the rows of each model forward at step i (a partition of the batch; default: one
    forward of all). The rollout forwards in the trainer's batches, so that the trainer's
    recomputation of a log-prob runs the very same forward and gets the very same number.
    ``reference``: a :class:`~digenrl.units.klref.RolloutReference`, run on each forward batch's samples
    that train the step (after the step has used the policy's velocity).
    ``out``: buffers (views) to write the trajectory into (units/branch.py: each segment into the
    whole tree's), instead of new ones.
    """
    if isinstance(randn, torch.Generator):
        gen = randn
        randn = lambda shape: torch.randn(shape, generator=gen)  # noqa: E731
    n = len(sigmas) - 1
    if sde_mask is None:
        sde_mask = torch.ones(n, dtype=torch.bool)
    x = noise.float()
    if batches is not None:  # each forward's rows on the host (the reference reads them) and the device
        batches = [[(rows, rows.to(x.device)) for rows in step] for step in batches]
    # the trajectory is written into buffers allocated once (no per-step lists stacked at the end: that
    # held the trajectory twice), and nothing the model returned outlives its step's use of it (a
    # compiled forward with CUDA graphs, compile_mode reduce-overhead, overwrites its output next call)
    b, shape = x.shape[0], tuple(x.shape[1:])
    if out is not None:
        latents, noises, log_probs = out.latents, out.noise, out.log_probs
    else:
        latents = torch.empty((b, n + 1, *shape), device=x.device, dtype=torch.float32)
        noises = torch.empty((b, n, *shape), device=x.device, dtype=torch.float32)
        log_probs = torch.zeros((b, n), device=x.device, dtype=torch.float32)
    latents[:, 0] = x
    for i in range(n):
        eps = None
        if eta > 0 and bool(sde_mask[i]):
            eps = randn(tuple(x.shape)).to(device=x.device, dtype=torch.float32)
        x_next = latents[:, i + 1]
        for host_rows, rows in batches[i] if batches is not None else [(None, None)]:
            # each forward batch's step apart, at once: its log-prob reduced in the shape the trainer
            # reduces it in, and its velocity used before the next forward runs
            v = _velocity(adapter, x, sigmas[i], cond, rows, host_rows)
            if rows is None:
                step, lp, mu = sde_step(kind, x, v, sigmas, i, eta, eps)
                x_next.copy_(step)
                torch.sub(step, mu, out=noises[:, i])
                log_probs[:, i] = lp
            else:
                step, lp, mu = sde_step(kind, x[rows], v, sigmas, i, eta, None if eps is None else eps[rows])
                x_next[rows], noises[rows, i], log_probs[rows, i] = step, step - mu, lp
            if reference is not None:
                reference.at_step(adapter, x, sigmas, i, cond, host_rows)
        x = x_next.contiguous()  # the next forward's input as one dense tensor (as the trainer's rows)
    return Trajectory(latents, log_probs, sigmas, sde_mask, noises)


def _velocity(adapter, x: torch.Tensor, sigma: torch.Tensor, cond, rows, host_rows=None) -> torch.Tensor:
    """The model's velocity at noise level ``sigma`` for the given rows (None: all) of the batch
    (``host_rows``: the same on the CPU, for the conditioning's host part)."""
    if rows is not None:
        x, cond = x[rows], cond.select(rows, host_rows)
    return adapter.velocity(x, adapter.sigma_input(sigma.expand(x.shape[0])), cond)


def recompute_logprob(
    adapter, cond, x: torch.Tensor, x_next: torch.Tensor, sigmas: torch.Tensor, i: int, kind: str, eta: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Log-prob of the recorded transition x -> x_next under the CURRENT weights (with grad).

    Returns (log_prob (B,), mu (B, ...), std_i) -- mu and std feed the KL term.
    """
    v = adapter.velocity(x, adapter.sigma_input(sigmas[i].expand(x.shape[0])), cond)
    return logprob_of_velocity(v, x, x_next, sigmas, i, kind, eta)


def logprob_of_velocity(
    v: torch.Tensor,
    x: torch.Tensor,
    x_next: torch.Tensor,
    sigmas: torch.Tensor,
    i: int,
    kind: str,
    eta: float,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(log_prob (B,), mu, std_i) of the transition x -> x_next given the model's velocity ``v`` at step i."""
    s, s_next = float(sigmas[i]), float(sigmas[i + 1])
    std = noise_std(kind, sigmas, i, eta)
    mu = step_mean(kind, x, v, s, s_next, std)
    return transition_logprob(kind, x_next, mu, step_scale(kind, s, s_next, std)), mu, std
