"""Stale samples' log-prob gradient (docs/algorithms.md, "Stale samples"): the recorded step noise,
and the recentred log-prob whose gradient is the on-policy score without the stale drift term."""

from __future__ import annotations

import math

import torch

from digenrl.algorithms import sde
from digenrl.units.train import recentred_logprob


def test_sample_records_each_steps_noise(tiny_cfg):
    """latents[i+1] - noise[i] is the step mean the rollout drew around (0 noise on ODE steps)."""
    from digenrl.adapters import build_adapter

    cfg = tiny_cfg()
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a red car"]).repeat_interleave(3)
    g = torch.Generator().manual_seed(0)
    s = ad.sigmas(4)
    mask = torch.tensor([True, False, True, True])
    traj = sde.sample(ad, cond, ad.initial_noise(3, g), s, "flow_grpo", 0.9, g, mask)
    assert traj.noise.shape == traj.latents[:, 1:].shape
    assert torch.all(traj.noise[:, 1] == 0)  # the ODE step
    for i in (0, 2):
        v = ad.velocity(traj.latents[:, i], s[i].expand(3), cond)
        _, mu, _ = sde.logprob_of_velocity(
            v, traj.latents[:, i], traj.latents[:, i + 1], s, i, "flow_grpo", 0.9
        )
        assert torch.allclose(traj.latents[:, i + 1] - traj.noise[:, i], mu, atol=1e-5)
        assert traj.noise[:, i].abs().mean() > 0


def test_recentred_logprob_has_behaviour_value_and_score_gradient():
    """Value: the behaviour log-prob. Gradient in mu: noise / (scale^2 D), the on-policy score; the raw
    sample's gradient adds (mu_behaviour - mu) / (scale^2 D), the drift of a stale sample."""
    torch.manual_seed(0)
    s = torch.tensor([1.0, 0.7, 0.4, 0.0])
    i, eta, kind = 2, 0.9, "flow_grpo"
    std = sde.noise_std(kind, s, i, eta)
    scale = sde.step_scale(kind, float(s[i]), float(s[i + 1]), std)
    mu_behaviour = torch.randn(2, 6)
    noise = scale * torch.randn(2, 6)
    x_next = mu_behaviour + noise
    mu = (mu_behaviour + 0.3 * torch.randn(2, 6)).requires_grad_(True)  # the policy moved since

    lp = recentred_logprob(kind, mu, noise, s, i, std)
    behaviour = sde.transition_logprob(kind, x_next, mu_behaviour, scale)
    assert torch.allclose(lp, behaviour, atol=1e-5)
    (g_score,) = torch.autograd.grad(lp.sum(), mu)
    assert torch.allclose(g_score, noise / scale**2 / 6, atol=1e-5)

    raw = sde.transition_logprob(kind, x_next, mu, scale)
    (g_raw,) = torch.autograd.grad(raw.sum(), mu)
    drift = (mu_behaviour - mu.detach()) / scale**2 / 6
    assert torch.allclose(g_raw - g_score, drift, atol=1e-4)
    assert drift.norm() > 0.1 * g_score.norm()  # with this shift the drift is not negligible
    assert math.isfinite(float(lp.detach().sum()))
