"""Advantages, the clipped objective, KL and trained-timestep selection against closed forms."""

import torch

from digenrl.algorithms import grpo


def test_group_advantages_per_prompt_closed_form():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 10.0])
    a = grpo.group_advantages(r, 4)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.allclose(a[:4], (g - 2.5) / (g.std() + 1e-4))
    assert torch.all(a[4:] == 0)  # zero-variance group: no signal


def test_global_std_and_clipping():
    r = torch.tensor([0.0, 0.0, 30.0, 1.0, 2.0, 3.0])
    a = grpo.group_advantages(r, 3, std="global", clip=1.5)
    assert a[2] == 1.5  # (30 - 10) / std(r) > 1.5: clipped
    expected = (torch.tensor([1.0, 2.0, 3.0]) - 2.0) / (r.std() + 1e-4)
    assert torch.allclose(a[3:], expected)


def test_clipped_objective():
    adv = torch.tensor([1.0, -1.0, 1.0])
    logp_old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5]))
    loss, st = grpo.clipped_objective(logp, logp_old, adv, 0.2)
    # A>0, rho=1.5: clipped to 1.2 -> max(-1.5, -1.2) = -1.2 ; A<0, rho=1.5: max(1.5, 1.2) = 1.5 ; A>0 rho=.5: -0.5
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
