"""DiffusionNFT (``algorithm.name: diffusion_nft``): the loss and the implicit velocities side by side
with an independent re-statement of the reference implementation's formulas, closed forms (beta -> 0,
all-positive / all-negative samples, flat groups), the old policy's ramped EMA, its defaults, and the
units: clean-latent rollouts and a train unit whose TSP shares add up to the whole gradient."""

from __future__ import annotations

import pytest
import torch

from digenrl.algorithms import nft
from digenrl.config.run import load_config
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.policy.model import Policy
from digenrl.rewards import build_reward
from digenrl.units.advantages import assign_advantages
from digenrl.units.rollout import rollout_unit, scored
from digenrl.units.train import train_unit
from tests.helpers import TINY

# --------------------------------------------------------------------------- the reference, restated


def reference_nft_loss(forward_prediction, old_prediction, xt, x0, t, advantages, beta, adv_clip_max):
    """The DiffusionNFT reference implementation's loss for one noise level, restated in its own
    structure and names: NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``, ``main()``, the training
    loop's "Policy Gradient Loss" / "adaptive weighting" block (read in the fork pkuhxy/DiffusionNFT
    at commit 619456a; Flow-Factory ``src/flow_factory/trainers/nft.py`` @ 328ed19 has the same block).
    Returns (policy_loss as the reference averages it: a mean over the batch, positive_prediction,
    implicit_negative_prediction)."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    advantages_clip = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    r = torch.clamp(normalized_advantages_clip, 0, 1)
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (
            torch.abs(x0_prediction.double() - x0.double())
            .mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (
            torch.abs(negative_x0_prediction.double() - x0.double())
            .mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(
        dim=tuple(range(1, x0.ndim))
    )
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy_loss = (ori_policy_loss * adv_clip_max).mean()
    return policy_loss, positive_prediction, implicit_negative_prediction


def inputs(b=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (b, 4, 8, 8)
    x0, eps = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.rand(b, generator=g) * 0.9 + 0.05
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps  # the reference's forward noising
    v_old = (eps - x0) + 0.3 * torch.randn(shape, generator=g)
    v = v_old + 0.05 * torch.randn(shape, generator=g)
    adv = torch.tensor([-7.0, -2.0, -0.3, 0.0, 1.5, 6.0])[:b]
    return x0, eps, t, xt, v, v_old, adv


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_loss_and_velocities_agree_with_the_reference_formulas(beta):
    x0, eps, t, xt, v, v_old, adv = inputs()
    assert torch.equal(nft.forward_noise(x0, t, eps), xt)
    v_ours = v.clone().requires_grad_(True)
    v_theirs = v.clone().requires_grad_(True)
    r = nft.optimality(adv, 5.0)
    ours, _ = nft.nft_loss(v_ours, v_old, xt, x0, t, r, beta, 5.0)
    theirs, pos_ref, neg_ref = reference_nft_loss(v_theirs, v_old, xt, x0, t, adv, beta, 5.0)
    pos, neg = nft.implicit_velocities(v, v_old, beta)
    torch.testing.assert_close(pos, pos_ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(neg, neg_ref.detach(), rtol=0, atol=1e-6)
    # the reference divides by a float64 weight (so its loss is float64); ours stays fp32: fp32 rounding
    torch.testing.assert_close(ours.mean().double(), theirs, rtol=1e-6, atol=0)
    ours.mean().backward()
    theirs.backward()
    torch.testing.assert_close(v_ours.grad, v_theirs.grad.float(), rtol=1e-5, atol=1e-9)


def test_optimality_maps_clipped_advantages_to_zero_one():
    r = nft.optimality(torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0]), 5.0)
    assert r.tolist() == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def _grad(v, v_old, xt, x0, t, r, beta):
    v = v.clone().requires_grad_(True)
    nft.nft_loss(v, v_old, xt, x0, t, r, beta, 5.0)[0].sum().backward()
    return v.grad


def test_beta_to_zero_and_at_the_old_policy_the_gradient_is_advantage_weighted_flow_matching():
    """At v = v_old, v+ = v- = v_old for every beta, and the gradient is (2r - 1) x adv_clip x the
    gradient of the weighted x0 error at v_old; as beta -> 0 the same holds for any v (v+, v- -> v_old)."""
    x0, _, t, xt, v, v_old, adv = inputs()
    r = nft.optimality(adv, 5.0)
    at_old = v_old.clone().requires_grad_(True)
    nft.adaptive_x0_error(xt - t.view(-1, 1, 1, 1) * at_old, x0).sum().backward()
    want = (2 * r - 1).view(-1, 1, 1, 1) * 5.0 * at_old.grad
    for beta in (1.0, 0.1):
        torch.testing.assert_close(_grad(v_old, v_old, xt, x0, t, r, beta), want, rtol=1e-5, atol=1e-6)
    got = _grad(v, v_old, xt, x0, t, r, 1e-4)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * want.abs().max().item())
    assert (got - want).abs().max() > 0  # a true limit, not an identity at finite beta


def test_all_positive_and_all_negative_samples_fit_one_implicit_policy():
    """r = 1: the loss is adv_clip / beta x the weighted x0 error of v+ only (the x0 it predicts is
    the sample's own when v+ is the true velocity eps - x0); r = 0: of v- only."""
    x0, eps, t, xt, v, v_old, _ = inputs()
    beta, tt = 0.5, t.view(-1, 1, 1, 1)
    pos, neg = nft.implicit_velocities(v, v_old, beta)
    ones, zeros = torch.ones(len(t)), torch.zeros(len(t))
    loss_pos, _ = nft.nft_loss(v, v_old, xt, x0, t, ones, beta, 5.0)
    loss_neg, _ = nft.nft_loss(v, v_old, xt, x0, t, zeros, beta, 5.0)
    torch.testing.assert_close(loss_pos, 5.0 / beta * nft.adaptive_x0_error(xt - tt * pos, x0))
    torch.testing.assert_close(loss_neg, 5.0 / beta * nft.adaptive_x0_error(xt - tt * neg, x0))
    # a velocity whose positive policy is the exact flow (eps - x0) has zero positive loss
    exact = (eps - x0 - (1 - beta) * v_old) / beta
    assert nft.nft_loss(exact, v_old, xt, x0, t, ones, beta, 5.0)[0].abs().max() < 1e-4
    # adaptive weighting: the error per sample is mean(d^2) / mean|d|, invariant to which sample is far
    d = torch.full((1, 4, 8, 8), 3.0)
    assert nft.adaptive_x0_error(d, torch.zeros_like(d)).item() == pytest.approx(3.0)


def test_old_policy_decay_ramps_as_the_reference_schedules():
    assert [nft.old_decay(s, 0, 0.001, 0.5) for s in (0, 1, 250, 500, 900)] == [0.0, 0.001, 0.25, 0.5, 0.5]
    assert nft.old_decay(74, 75, 0.0075, 0.999) == 0.0 and nft.old_decay(75 + 200, 75, 0.0075, 0.999) == 0.999
    w = {"a": torch.zeros(3)}
    cfg = load_config(None, ["algorithm.name=diffusion_nft", "algorithm.nft.decay_rate=0.25"]).algorithm.nft
    old = nft.OldPolicy(w, cfg)
    w["a"].fill_(1.0)
    old.step(publish=False)  # an intermediate mini-batch step: counted, not blended
    assert old.average["a"].tolist() == [0.0] * 3 and old.steps == 1
    old.step(publish=True)  # step 2: decay 0.5 -> half way
    assert old.average["a"].tolist() == [0.5] * 3


def test_defaults_select_the_ode_sampler_at_the_papers_steps():
    cfg = load_config(None, ["algorithm.name=diffusion_nft"])
    assert (cfg.sampling.noise_level, cfg.sampling.steps) == (0.0, 10)
    assert (cfg.algorithm.nft.beta, cfg.algorithm.nft.decay_rate, cfg.algorithm.nft.decay_max) == (
        1.0,
        0.001,
        0.5,
    )
    mine = load_config(None, ["algorithm.name=diffusion_nft", "sampling.steps=6", "sampling.noise_level=0.7"])
    assert (mine.sampling.steps, mine.sampling.noise_level) == (6, 0.7)  # set explicitly: kept
    assert load_config(None, []).sampling.noise_level == 1.0  # flow_grpo's unchanged
    from digenrl.config.base import ConfigError

    with pytest.raises(ConfigError, match="algorithm.nft.noise_levels"):
        load_config(None, ["algorithm.name=diffusion_nft", "algorithm.nft.noise_levels=11"])


# ------------------------------------------------------------------------------------------ units
SMALL = [*TINY, "algorithm.name=diffusion_nft", "placement.mode=local"]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, SMALL)
    torch.manual_seed(cfg.train.seed)
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed)
    reward = build_reward(cfg.reward)
    policy = Policy(cfg)
    return cfg, policy, reward, prompts.for_iteration(0, 2)


def test_rollout_carries_clean_latents_and_the_noise_plan(setup):
    cfg, policy, reward, prompts = setup
    whole = scored(rollout_unit(policy, prompts, [0, 1], 0, cfg.train.seed), reward)
    assert whole.latents.shape[1] == 1 and whole.log_probs.shape == (8, 0)  # no trajectory
    # ... nor its storage behind a view: what is pickled to a trainer is the clean latents alone
    assert whole.latents.untyped_storage().nbytes() == whole.latents.numel() * 4
    assert whole.train_idx.shape == (8, 4) and whole.noise_seeds.shape == (8, 4)
    assert all(sorted(row.tolist()) == [0, 1, 2, 3] for row in whole.train_idx)  # K = N distinct sigmas
    half = scored(rollout_unit(policy, prompts[1:], [1], 0, cfg.train.seed, samples=(2, 4)), reward)
    torch.testing.assert_close(half.latents, whole.latents[6:])  # a part of a group: the same samples
    assert torch.equal(half.train_idx, whole.train_idx[6:]) and torch.equal(
        half.noise_seeds, whole.noise_seeds[6:]
    )


def test_tsp_shares_add_up_to_the_whole_gradient_and_the_old_policy_stays_put(setup):
    cfg, policy, reward, prompts = setup
    unit = scored(rollout_unit(policy, prompts, [0, 1], 0, cfg.train.seed), reward)
    assign_advantages([unit], cfg)
    terms = len(unit) * unit.train_idx.shape[1]
    params = policy.params
    before = {n: t.clone() for n, t in policy.old.average.items()}

    def grads(*shares):
        for p in params:
            p.grad = None
        stats = [train_unit(policy, unit, terms, r, d) for r, d in shares]
        return [p.grad.clone() for p in params], stats

    whole, (stats,) = grads((0, 1))
    split, parts = grads((0, 2), (1, 2))
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert any(g.abs().sum() > 0 for g in whole)
    assert stats["terms"] == terms == sum(p["terms"] for p in parts)
    assert stats["nft_old_deviation"] == 0.0  # version 0: the old policy is the current one
    for p in params:
        p.grad = None
    assert all(torch.equal(before[n], t) for n, t in policy.old.average.items())  # swapped back, untouched


def test_cfg_families_train_cfg_free_and_may_evaluate_with_cfg():
    from digenrl.run.evaluate import evaluate_policy

    qwen = [
        "model.adapter=qwen_image",
        "model.lora.targets=[to_q, to_k, to_v, to_out.0, txt_in, norm_out.linear, proj_out]",
        "algorithm.name=diffusion_nft",
        "sampling.eval_steps=2",
        "placement.mode=local",
    ]
    cfg = load_config(None, qwen)
    assert cfg.sampling.guidance == 1.0 and cfg.sampling.eval_guidance is None  # CFG-free rollouts
    assert load_config(None, qwen + ["sampling.guidance=4"]).sampling.guidance == 4.0  # explicit: kept
    assert load_config(None, qwen[:2] + ["algorithm.name=flow_grpo"]).sampling.guidance == 3.5
    prompts = load_prompts(cfg.prompts)[:2]
    reward = build_reward(cfg.reward)
    torch.manual_seed(0)
    plain = Policy(cfg)
    torch.manual_seed(0)
    guided = Policy(load_config(None, qwen + ["sampling.eval_guidance=4.0"]))
    a = evaluate_policy(plain, reward, prompts)
    b = evaluate_policy(guided, reward, prompts)
    assert not torch.equal(a.pixels, b.pixels)  # the same weights and noise, evaluated with CFG
    assert guided.adapter.sampling.guidance == 1.0  # restored: rollouts stay CFG-free


def test_the_planner_models_clean_latent_samples_and_an_old_policy_forward_per_noise_level():
    from dataclasses import replace

    from digenrl.planner.call_times import rollout_unit_time, train_unit_time
    from digenrl.planner.workload import Workload

    class Unit:  # a call-time table: 1 s per train forward/backward, 0.25 s per no-grad forward
        rollout_unit_factor = train_unit_factor = 1.0
        rollout_overhead_s = train_overhead_s = 0.0

        def train_step(self, b):
            return 1.0

        def ref_forward(self, b):
            return 0.25

        def rollout_step(self, b):
            return 0.1

        def encode(self, n):
            return 0.0

        def decode(self, b):
            return 0.0

        def reward(self, b):
            return 0.0

    grpo = Workload.from_config(load_config(None, ["sampling.steps=10", "train.micro_batch=4"]))
    w = Workload.from_config(load_config(None, ["algorithm.name=diffusion_nft", "train.micro_batch=4"]))
    assert w.forward_process and (w.steps, w.trained_steps) == (10, 10)
    # one latent (+ K seeds) per sample on the wire, not N + 1 latents and N log-probs
    assert w.sample_bytes < grpo.sample_bytes / 5
    t = Unit()
    # 1 group (8 samples, 2 micro-batches) on TSP rank 0 of 2: 5 levels x 2 micro-batches x (1 + 0.25)
    assert train_unit_time(t, w, 1, 0, 2, 4) == pytest.approx(5 * 2 * 1.25)
    assert train_unit_time(t, replace(w, kl=True), 1, 0, 2, 4) == pytest.approx(5 * 2 * 1.5)
    assert train_unit_time(t, replace(w, forward_process=False), 1, 0, 2, 4) == pytest.approx(5 * 2 * 1.0)
    # rollout: one forward of the unit per step (no micro-batch split for log-probs to match)
    assert rollout_unit_time(t, w, 2)[0] == pytest.approx(10 * 0.1)


def test_the_memory_model_counts_the_old_policy_sharded():
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.params import CostParams
    from digenrl.planner.workload import Workload

    w = Workload.from_config(load_config(None, ["algorithm.name=diffusion_nft", "model.lora=null"]))
    mem = MemoryModel(w, CostParams())
    one, two = mem.train_parts(1, 1, False), mem.train_parts(2, 1, False)
    assert one["old policy"] == w.params.total * 4 == 2 * two["old policy"]
    grpo = Workload.from_config(load_config(None, ["model.lora=null"]))
    assert "old policy" not in MemoryModel(grpo, CostParams()).train_parts(1, 1, False)


def test_resume_continues_exactly_with_the_old_policy(tmp_path):
    from safetensors.torch import load_file

    from digenrl.engine.local import LocalTrainer

    base = SMALL + [
        "train.prompts_per_iteration=1",
        "algorithm.nft.decay_rate=0.3",
        "output.checkpoint_every=1",
    ]
    LocalTrainer(load_config(None, base + ["train.iterations=3"])).run(tmp_path / "whole")
    LocalTrainer(load_config(None, base + ["train.iterations=2"])).run(tmp_path / "cut")
    ckpt = tmp_path / "cut" / "checkpoints" / "iter-000002"
    assert (ckpt / "old_policy.safetensors").is_file()
    resumed = LocalTrainer(load_config(None, base + ["train.iterations=3"]), resume=ckpt)
    assert resumed.policy.old.steps == 2
    resumed.run(tmp_path / "resumed")
    want = load_file(tmp_path / "whole" / "final" / "pytorch_lora_weights.safetensors")
    got = load_file(tmp_path / "resumed" / "final" / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
