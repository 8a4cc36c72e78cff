"""The SDE step and its log-prob against closed forms, and ratio == 1 on unchanged weights."""

import math

import pytest
import torch

from digenrl.algorithms import sde


def sigmas(n=6):
    return torch.linspace(1, 0, n + 1)


def test_logprob_equals_independent_gaussian_density():
    torch.manual_seed(0)
    x, v = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    s = torch.tensor([1.0, 0.7, 0.4, 0.0])
    eps = torch.randn(3, 5, 4)
    x_next, lp, mu = sde.sde_step("flow_grpo", x, v, s, 1, 0.8, eps)
    # closed form, written independently: std_i = eta sqrt(s/(1-s)), scale = std_i sqrt(s_i - s_{i+1})
    si, sn = 0.7, 0.4
    std = 0.8 * math.sqrt(si / (1 - si))
    mean = x + (sn - si) * (v + std**2 / (2 * si) * (x + (1 - si) * v))
    dist = torch.distributions.Normal(mean, std * math.sqrt(si - sn))
    expected = dist.log_prob(x_next).reshape(3, -1).mean(1)
    assert torch.allclose(mu, mean, atol=1e-6)
    assert torch.allclose(lp, expected, atol=1e-5)
    assert torch.allclose(x_next, mean + std * math.sqrt(si - sn) * eps, atol=1e-6)


def test_flow_grpo_std_at_sigma_one_uses_sigma_1():
    s = torch.tensor([1.0, 0.8, 0.3, 0.0])
    assert sde.noise_std("flow_grpo", s, 0, 0.5) == pytest.approx(0.5 * math.sqrt(1.0 / (1 - 0.8)))
    assert sde.noise_std("dance_grpo", s, 2, 0.3) == 0.3
    assert sde.noise_std("cps", s, 1, 0.5) == pytest.approx(0.3 * math.sin(0.25 * math.pi))


def test_eta_zero_is_the_euler_step_of_diffusers():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(5)
    x, v = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    sched.set_begin_index(2)
    ref = sched.step(v, sched.timesteps[2], x, return_dict=False)[0]
    ours, lp, _ = sde.sde_step("flow_grpo", x, v, sched.sigmas, 2, 0.7, None)
    assert torch.allclose(ours, ref, atol=1e-6) and torch.all(lp == 0)


def test_cps_step_and_logprob():
    torch.manual_seed(1)
    x, v, eps = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    s = torch.tensor([1.0, 0.6, 0.0])
    x_next, lp, mu = sde.sde_step("cps", x, v, s, 0, 0.5, eps)
    std = 0.6 * math.sin(0.25 * math.pi)
    x0, x1 = x - 1.0 * v, x + 0.0 * v
    expected_mu = (1 - 0.6) * x0 + math.sqrt(0.36 - std**2) * x1
    assert torch.allclose(mu, expected_mu, atol=1e-6)
    assert torch.allclose(lp, -((x_next - mu) ** 2).mean(1), atol=1e-6)


def test_recomputed_logprob_gives_ratio_exactly_one(tiny_cfg):
    """A rollout's behaviour log-probs, recomputed with unchanged weights and the same batch: ratio == 1."""
    from digenrl.adapters import build_adapter

    cfg = tiny_cfg()
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a red car"]).repeat_interleave(4)
    g = torch.Generator().manual_seed(0)
    s = ad.sigmas(5)
    traj = sde.sample(ad, cond, ad.initial_noise(4, g), s, "flow_grpo", 0.9, g)
    for i in range(4):
        with torch.enable_grad():
            lp, _, _ = sde.recompute_logprob(
                ad, cond, traj.latents[:, i], traj.latents[:, i + 1], s, i, "flow_grpo", 0.9
            )
        assert torch.equal(torch.exp(lp - traj.log_probs[:, i]), torch.ones(4))
