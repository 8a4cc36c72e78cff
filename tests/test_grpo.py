"""Advantages, the clipped objective, KL and trained-timestep selection against closed forms."""

import numpy as np
import pytest
import torch

from digenrl.algorithms import grpo


def test_group_advantages_per_prompt_closed_form():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 10.0])
    a = grpo.group_advantages(r, 4, ddof=1)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.allclose(a[:4], (g - 2.5) / (g.std() + 1e-4))
    assert torch.all(a[4:] == 0)  # zero-variance group: no signal


def test_global_std_and_clipping():
    r = torch.tensor([0.0, 0.0, 30.0, 1.0, 2.0, 3.0])
    a = grpo.group_advantages(r, 3, std="global", clip=1.5, ddof=1)
    assert a[2] == 1.5  # (30 - 10) / std(r) > 1.5: clipped
    expected = (torch.tensor([1.0, 2.0, 3.0]) - 2.0) / (r.std() + 1e-4)
    assert torch.allclose(a[3:], expected)


@pytest.mark.parametrize("value", [0.7, 22.37, 1000.1])
@pytest.mark.parametrize("G", [8, 24])
@pytest.mark.parametrize("std", ["per_prompt", "global"])
def test_zero_variance_group_gets_exactly_zero(value, G, std):
    """Equal rewards not exact in fp32 (0.7, PickScore's ~22 scale, 1000.1): every advantage exactly 0.

    Before the float64 fix, eight rewards of 22.37 gave each sample +1.9e-2 and eight of 1000.1 -0.37."""
    flat = torch.full((G,), value, dtype=torch.float32)
    spread = value * (1 + torch.linspace(-0.5, 0.5, G))
    for ddof in ({}, {"ddof": 0}, {"ddof": 1}):  # the default first: the same call fails on the fp32 code
        a = grpo.group_advantages(torch.cat([flat, spread]), G, std=std, **ddof)
        assert torch.all(a[:G] == 0), a[:G]
        assert a[G:].abs().max() > 0.5  # the other group still carries its signal


@pytest.mark.parametrize("std", ["per_prompt", "global"])
def test_std_ddof_matches_numpy(std):
    """ddof 0 = numpy's population std (flow_grpo's np.std), ddof 1 = the sample std; float64 reference."""
    rng = np.random.default_rng(0)
    r = rng.normal(22.0, 0.8, size=(3, 8))
    for ddof in (0, 1):
        ref_std = r.std(axis=1, ddof=ddof, keepdims=True) if std == "per_prompt" else r.std(ddof=ddof)
        want = np.clip((r - r.mean(axis=1, keepdims=True)) / (ref_std + 1e-4), -5, 5).reshape(-1)
        got = grpo.group_advantages(torch.tensor(r.reshape(-1), dtype=torch.float64), 8, std=std, ddof=ddof)
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    a0 = grpo.group_advantages(torch.tensor(r.reshape(-1)), 8, std=std, ddof=0)
    a1 = grpo.group_advantages(torch.tensor(r.reshape(-1)), 8, std=std, ddof=1)
    if std == "per_prompt":  # the sample std is sqrt(G / (G-1)) larger: advantages 0.935x at G = 8
        assert torch.allclose(a1, a0 * (7 / 8) ** 0.5, rtol=1e-4)


def test_clipped_objective():
    adv = torch.tensor([1.0, -1.0, 1.0])
    logp_old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5]))
    loss, st = grpo.clipped_objective(logp, logp_old, adv, 0.2)
    # A>0, rho=1.5: clipped to 1.2 -> max(-1.5, -1.2) = -1.2 ; A<0, rho=1.5: max(1.5, 1.2) = 1.5 ; A>0 rho=.5:
    # -0.5
    assert torch.allclose(loss, torch.tensor([-1.2, 1.5, -0.5]))
    assert st["clip_frac"] == 1.0
    w = torch.tensor([2.0, 1.0, 1.0])
    loss_w, _ = grpo.clipped_objective(logp, logp_old, adv, 0.2, w)
    assert torch.allclose(loss_w, loss * w)


def test_on_policy_gradient_is_the_policy_gradient():
    logp = torch.tensor([0.3, -0.2], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, _ = grpo.clipped_objective(logp, logp.detach(), adv, 1e-4)
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv)  # d/dlogp of -A*exp(logp - logp_old) at ratio 1


def test_kl_closed_form():
    mu, mu_ref = torch.ones(2, 3), torch.zeros(2, 3)
    assert torch.allclose(grpo.kl_to_reference(mu, mu_ref, 0.5), torch.full((2,), 1 / (2 * 0.25)))


def test_timestep_selection_modes():
    g = torch.Generator().manual_seed(0)
    mask, idx = grpo.select_timesteps("fraction", 10, 3, g, fraction=0.99)
    assert mask.all() and idx.shape == (3, 9) and torch.equal(idx[0], torch.arange(9))
    mask, idx = grpo.select_timesteps("random", 10, 4, g, fraction=0.6)
    assert idx.shape == (4, 5) and idx.max() <= 8  # never the last step
    assert all(len(set(row.tolist())) == 5 for row in idx)
    mask, idx = grpo.select_timesteps("window", 10, 2, g, window=3)
    start = int(idx[0, 0])
    assert mask.sum() == 3 and mask[start : start + 3].all() and start + 3 <= 9
    _, slide0 = grpo.select_timesteps("window", 10, 1, g, window=2, iteration=0, shift_every=5)
    _, slide1 = grpo.select_timesteps("window", 10, 1, g, window=2, iteration=5, shift_every=5)
    assert int(slide1[0, 0]) == int(slide0[0, 0]) + 1


def test_window_range_default_is_flow_grpo_fast():
    """(0, 0.5): the window lies in the first half, as flow_grpo-Fast's randint(0, N//2 - w)."""
    g = torch.Generator().manual_seed(0)
    # flow_grpo-Fast FLUX: N = 6, w = 3, range (0, 3): the only window is steps 0..2
    for _ in range(5):
        mask, idx = grpo.select_timesteps("window", 6, 2, g, window=3, window_range=(0.0, 0.5))
        assert mask.tolist() == [True, True, True, False, False, False] and idx[0].tolist() == [0, 1, 2]
    starts = set()
    for _ in range(200):  # N = 10, w = 2: starts 0..3, every one drawn, never past step 4
        mask, idx = grpo.select_timesteps("window", 10, 1, g, window=2, window_range=(0.0, 0.5))
        starts.add(int(idx[0, 0]))
        assert mask.nonzero().max() <= 4
    assert starts == {0, 1, 2, 3}
    # a range in the middle; sliding (MixGRPO) wraps around inside the range
    got = [
        int(
            grpo.select_timesteps(
                "window", 10, 1, g, window=2, iteration=it, shift_every=1, window_range=(0.2, 0.6)
            )[1][0, 0]
        )
        for it in range(6)
    ]
    assert got == [2, 3, 4, 2, 3, 4]
    assert grpo.window_bounds(10, 2, (0.0, 1.0)) == (
        0,
        8,
        2,
    )  # the full range: starts 0..7, never the last step
    assert grpo.window_bounds(10, 3, (0.0, 0.2)) is None
