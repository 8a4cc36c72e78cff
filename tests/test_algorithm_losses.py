"""AWM, Flow-DPPO, GRPO-Guard and online DPO: each loss equals a hand computation on a small example,
plus the edge cases their papers name (zero advantage; the trust region's boundary; Guard's
normalised ratio; an identical DPO pair), and each trains through the units (local trainer, 2
iterations). The math: docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch

from digenrl.algorithms import awm, dpo, dppo, guard
from digenrl.algorithms.sde import step_scale, transition_logprob

D = torch.float64


# ------------------------------------------------------------------------------------------- AWM
def test_awm_loss_is_the_advantage_weighted_matching_error_by_hand():
    v = torch.tensor([[1.0, 2.0], [0.0, -1.0]], dtype=D)
    x0 = torch.tensor([[0.5, 0.5], [1.0, 1.0]], dtype=D)
    eps = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=D)
    t = torch.tensor([0.5, 0.25], dtype=D)
    adv = torch.tensor([2.0, -1.0], dtype=D)
    # targets eps - x0: [0.5, 0.5], [-1, -1]; errors: ((0.5)^2 + (1.5)^2) / 2 = 1.25, (1^2 + 0^2) / 2 = 0.5
    err = [1.25, 0.5]
    loss, e = awm.awm_loss(v, x0, eps, t, adv, "uniform")
    assert e.tolist() == err and loss.tolist() == [2.0 * 1.25, -1.0 * 0.5]
    loss_t, _ = awm.awm_loss(v, x0, eps, t, adv, "t")
    assert loss_t.tolist() == [2.0 * 0.5 * 1.25, -1.0 * 0.25 * 0.5]
    loss_g, _ = awm.awm_loss(v, x0, eps, t, adv, "ghuber", 0.25)
    c = awm.GHUBER_FLOOR
    want = [a * ti / 0.25 * ((ei + c) ** 0.25 - c**0.25) for a, ti, ei in zip([2.0, -1.0], [0.5, 0.25], err)]
    assert loss_g.tolist() == pytest.approx(want, rel=1e-12)


def test_awm_gradient_pulls_towards_good_samples_and_zero_advantage_adds_nothing():
    x0, eps, t = torch.zeros(2, 3, dtype=D), torch.ones(2, 3, dtype=D), torch.full((2,), 0.5, dtype=D)
    v = torch.full((2, 3), 2.0, dtype=D, requires_grad=True)
    loss, _ = awm.awm_loss(v, x0, eps, t, torch.tensor([1.0, 0.0], dtype=D))
    loss.sum().backward()
    # d/dv [A mean (v - 1)^2] = 2 A (v - 1) / 3: a descent step moves the good sample's v towards 1
    torch.testing.assert_close(v.grad[0], torch.full((3,), 2.0 / 3, dtype=D))
    assert torch.equal(v.grad[1], torch.zeros(3, dtype=D))  # A = 0: no gradient at all


# ----------------------------------------------------------------------------------------- DPPO
def _dppo(adv, logp, delta, diff=0.5, scale=0.5):
    """One step, mu - mu_old = ``diff`` everywhere: KL = diff^2 / (2 scale^2) = 0.5 exactly."""
    mu_old = torch.zeros(len(adv), 4, dtype=D)
    mu = (mu_old + diff).requires_grad_(True)
    logp = torch.tensor(logp, dtype=D, requires_grad=True)
    loss, st = dppo.dppo_objective(
        logp, torch.zeros_like(logp), torch.tensor(adv, dtype=D), mu, mu_old, scale, delta
    )
    loss.sum().backward()
    return loss.detach(), logp.grad, st


def test_dppo_kl_is_the_exact_gaussian_kl():
    mu, mu_old = torch.tensor([[1.0, 3.0]], dtype=D), torch.tensor([[0.0, 1.0]], dtype=D)
    # mean((1, 2)^2) / (2 * 0.5^2) = 2.5 / 0.5 = 5
    assert dppo.step_kl(mu, mu_old, 0.5).item() == 5.0


def test_dppo_masks_only_updates_past_the_boundary_that_move_away():
    r = math.log(1.5)  # ratio 1.5 > 1
    adv = [1.0, -1.0, 1.0, -1.0]
    logp = [r, r, -r, -r]  # ratios 1.5, 1.5, 2/3, 2/3
    # at the boundary (KL == delta, veRL-Omni's >=): A > 0 with rho > 1 and A < 0 with rho < 1 are blocked
    loss, grad, st = _dppo(adv, logp, delta=0.5)
    assert loss.tolist() == pytest.approx([0.0, 1.5, -2 / 3, 0.0])  # -A rho where kept
    assert grad.tolist() == pytest.approx([0.0, 1.5, -2 / 3, 0.0])  # d(-A rho)/dlogp = -A rho
    assert st["clip_frac"] == 0.5
    # just inside the trust region nothing is masked: the plain policy gradient
    loss_in, grad_in, _ = _dppo(adv, logp, delta=0.5 + 1e-9)
    assert loss_in.tolist() == pytest.approx([-1.5, 1.5, -2 / 3, 2 / 3])
    assert grad_in.tolist() == pytest.approx([-1.5, 1.5, -2 / 3, 2 / 3])


def test_dppo_ratio_one_and_zero_advantage_never_block():
    loss, grad, st = _dppo([1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 1.0, -1.0], delta=1e-6)
    assert st["clip_frac"] == 0.0
    assert loss.tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0])


# ---------------------------------------------------------------------------------------- Guard
def _guard_case(seed=0, n=3, elems=64, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    mu_old = torch.randn(n, elems, generator=g, dtype=D)
    mu = mu_old + 0.05 * torch.randn(n, elems, generator=g, dtype=D)
    eps = torch.randn(n, elems, generator=g, dtype=D)
    x_next = mu_old + scale * eps  # the behaviour step
    logp = transition_logprob("flow_grpo", x_next, mu, scale)  # the real kernel
    logp_old = transition_logprob("flow_grpo", x_next, mu_old, scale)
    return logp, logp_old, mu, mu_old, eps, scale


def test_guard_normalised_log_ratio_is_the_noise_projection_of_the_mean_shift():
    logp, logp_old, mu, mu_old, eps, s = _guard_case()
    got = guard.normalised_log_ratio(logp, logp_old, mu, mu_old, s)
    torch.testing.assert_close(got, ((mu - mu_old) * eps).mean(1))  # the hand identity (module docstring)
    raw = logp - logp_old
    assert not torch.allclose(raw, got)  # the raw ratio is another number
    assert guard.normalised_log_ratio(logp_old, logp_old, mu_old, mu_old, s).abs().max() == 0  # no move: 1


def test_guard_removes_the_raw_ratios_negative_drift():
    """Over many behaviour draws the raw log-ratio averages -mean(dmu^2) / (2 s^2) (left of 0); the
    normalised one averages 0."""
    s, dmu = 0.2, torch.full((1, 16), 0.1, dtype=D)
    g = torch.Generator().manual_seed(1)
    eps = torch.randn(20000, 16, generator=g, dtype=D)
    mu_old, mu = torch.zeros_like(eps), dmu.expand_as(eps)
    x_next = mu_old + s * eps
    raw = transition_logprob("flow_grpo", x_next, mu, s) - transition_logprob("flow_grpo", x_next, mu_old, s)
    normed = guard.normalised_log_ratio(raw, torch.zeros_like(raw), mu, mu_old, s)
    drift = -(0.1**2) / (2 * s**2)  # -0.125
    se = raw.std().item() / math.sqrt(len(raw))
    assert abs(raw.mean().item() - drift) < 4 * se
    assert abs(normed.mean().item()) < 4 * normed.std().item() / math.sqrt(len(normed))


def test_guard_loss_clips_the_normalised_ratio_by_hand():
    logp, logp_old, mu, mu_old, eps, s = _guard_case(n=2)
    adv = torch.tensor([1.0, -1.0], dtype=D)
    loss, _ = guard.guard_objective(logp, logp_old, adv, mu, mu_old, s, clip_range=1e-4)
    rho = torch.exp(((mu - mu_old) * eps).mean(1))
    want = [max(-a * r, -a * min(max(r, 1 - 1e-4), 1 + 1e-4)) for a, r in zip(adv.tolist(), rho.tolist())]
    assert loss.tolist() == pytest.approx(want, rel=1e-12)


def test_guard_and_dppo_scales_come_from_the_step():
    assert step_scale("flow_grpo", 0.8, 0.6, 0.5) == pytest.approx(0.5 * math.sqrt(0.2))


# ------------------------------------------------------------------------------------------ DPO
def test_dpo_pairs_are_each_groups_best_and_worst():
    rewards = torch.tensor([0.1, 0.5, 0.3, 0.2, 0.2, 0.2, 0.9, float("nan")], dtype=D)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    # group 1 is flat (zero advantage): no pair; group 2 has one scored sample: no pair
    assert dpo.best_worst_pairs(rewards, groups) == [(1, 0)]


def test_dpo_loss_by_hand():
    ew, ewr, el, elr = (torch.tensor([x], dtype=D) for x in (0.30, 0.32, 0.50, 0.49))
    loss, delta = dpo.dpo_loss(ew, ewr, el, elr, beta=100.0)
    d = (0.30 - 0.32) - (0.50 - 0.49)  # -0.03: the policy already prefers the chosen sample
    assert delta.item() == pytest.approx(d)
    assert loss.item() == pytest.approx(math.log1p(math.exp(100.0 * d)))  # -log sigmoid(-beta d)


def test_dpo_identical_pair_gives_log_two_and_no_gradient():
    v = torch.randn(1, 8, dtype=D, requires_grad=True)
    x0, eps = torch.randn(1, 8, dtype=D), torch.randn(1, 8, dtype=D)
    e = awm.matching_error(v, x0, eps)
    e_ref = awm.matching_error(v.detach() + 0.3, x0, eps)
    loss, delta = dpo.dpo_loss(e, e_ref, e, e_ref, beta=100.0)
    loss.sum().backward()
    assert delta.item() == 0.0 and loss.item() == pytest.approx(math.log(2.0))
    assert v.grad.abs().max().item() == 0.0


# ------------------------------------------------------------------------------ through the units
@pytest.mark.slow
@pytest.mark.parametrize("name", ["awm", "flow_dppo", "grpo_guard", "online_dpo"])
def test_each_trains_two_iterations_on_the_local_trainer(name, tmp_path):
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer
    from tests.helpers import QUIET, TINY

    cfg = load_config(
        None, [*TINY, *QUIET, f"algorithm.name={name}", "placement.mode=local", "train.iterations=2"]
    )
    result = LocalTrainer(cfg).run(tmp_path)
    assert len(result.metrics) == 2
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in result.metrics)
    first = result.metrics[0]
    if name in ("flow_dppo", "grpo_guard"):  # on-policy, one optimizer step: every ratio is 1
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    if name == "online_dpo":  # at version 0 the policy IS the reference (LoRA off = LoRA at 0): log 2
        assert first["loss"] == pytest.approx(math.log(2.0), rel=1e-5)
