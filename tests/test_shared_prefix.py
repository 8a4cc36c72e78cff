"""Shared-prefix group rollouts (``algorithm.shared_prefix``): with the prefix deterministic (noise 0
there) the branched sampler's trajectory equals the unshared sampler's from the same initial noise;
the transformer forwards per group drop by (G - 1) x k, counted with a forward hook; the prefix is
never trained; bad settings are refused naming the field; and on the engine the timeline invariants
hold (every branch trained once, one version per unit)."""

from __future__ import annotations

import pytest
import torch

from digenrl.algorithms.sde import sample
from digenrl.config.base import ConfigError
from digenrl.config.run import load_config
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.policy.model import Policy
from digenrl.rewards import build_reward
from digenrl.units.branch import branched_sample
from digenrl.units.rollout import rollout_unit, scored
from tests.helpers import QUIET, TINY

K = 2
SETS = [*TINY, "placement.mode=local", "sampling.steps=6"]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, SETS)
    torch.manual_seed(cfg.train.seed)
    policy = Policy(cfg)
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(0, 2)
    return cfg, policy, build_reward(cfg.reward), prompts


def counted_rows(policy):
    """A forward pre-hook on the transformer: the rows (samples) of every forward, appended."""
    rows = []

    def hook(module, args, kwargs):
        rows.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[0])

    return rows, policy.adapter.transformer.register_forward_pre_hook(hook, with_kwargs=True)


def test_branched_trajectory_equals_the_unshared_one_from_the_same_noise(setup):
    cfg, policy, _, prompts = setup
    ad, G, n = policy.adapter, 4, cfg.sampling.steps
    cond = ad.cond_for([p.text for p in prompts]).repeat_interleave(G)
    start = torch.randn(len(prompts), *ad.latent_shape(), generator=torch.Generator().manual_seed(3))
    sigmas, mask = ad.sigmas(n), torch.ones(n, dtype=torch.bool)
    mask[:K] = False  # noise 0 on the prefix
    args = (cfg.sampling.sde, 1.0)
    shared = branched_sample(
        ad, cond, start, G, sigmas, *args, torch.Generator().manual_seed(5), mask, None, K
    )
    plain = sample(
        ad, cond, start.repeat_interleave(G, 0), sigmas, *args, torch.Generator().manual_seed(5), mask
    )
    # the prefix: one row per group against G rows -- equal up to the batch shape's rounding
    torch.testing.assert_close(shared.latents[:, : K + 1], plain.latents[:, : K + 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.latents, plain.latents, rtol=0, atol=1e-4)  # ... and the branches
    torch.testing.assert_close(shared.log_probs, plain.log_probs, rtol=0, atol=1e-4)
    assert shared.log_probs[:, :K].abs().max() == 0 and shared.noise[:, :K].abs().max() == 0
    assert (shared.latents[:, -1] - shared.latents[:1, -1]).abs().amax() > 0.1  # the branches differ


def test_forwards_per_group_drop_by_g_minus_one_times_the_prefix(setup):
    cfg, policy, reward, prompts = setup
    G, n, groups = cfg.algorithm.group_size, cfg.sampling.steps, len(prompts)
    counts = {}
    for k in (0, K):
        c = cfg.model_copy(deep=True)
        c.algorithm.shared_prefix = k
        policy.cfg = c
        rows, handle = counted_rows(policy)
        try:
            unit = scored(rollout_unit(policy, prompts, [0, 1], 0, c.train.seed), reward)
        finally:
            handle.remove()
            policy.cfg = cfg
        counts[k] = sum(rows) / groups  # sample-forwards per group
        if k:  # the prefix is deterministic and never trained; the group shares it
            assert not unit.sde_mask[:k].any() and unit.sde_mask[k:].all()
            assert unit.train_idx.min() >= k
            assert (unit.latents[:G, : k + 1] - unit.latents[:1, : k + 1]).abs().max() < 1e-5
    assert counts[0] == G * n
    assert counts[0] - counts[K] == (G - 1) * K
    # the planner counts the same forwards, and prices the prefix as one forward per group
    from digenrl.planner.call_times import rollout_unit_time
    from digenrl.planner.workload import Workload

    work = {
        k: Workload.from_config(load_config(None, [*SETS, f"algorithm.shared_prefix={k}"])) for k in (0, K)
    }
    assert [work[k].rollout_forwards / work[k].prompts for k in (0, K)] == [counts[0], counts[K]]
    assert work[K].rollout_flops < work[0].rollout_flops
    times = {k: rollout_unit_time(PerSample(), work[k], groups=1)[0] for k in (0, K)}
    assert times[0] - times[K] == pytest.approx(0.1 * K * (G - 1))  # 0.1 s per sample-forward


class PerSample:
    """A call-time table: 0.1 s per sample in a rollout forward, nothing else."""

    rollout_unit_factor, rollout_overhead_s = 1.0, 0.0

    def rollout_step(self, b):
        return 0.1 * b

    def encode(self, n):
        return 0.0

    def decode(self, b):
        return 0.0

    def reward(self, b):
        return 0.0


def test_a_branch_tree_shares_each_nodes_steps_and_saves_its_forwards(setup):
    """G = 4, prefix 1, then 2 nodes that split in 2 at step 3: leaves 0, 1 (one node) share x_0..x_3 and
    differ after; leaves 0, 2 (two nodes) share x_0, x_1 only; forwards per group 1 + 2 x 2 + 4 x 3 = 17,
    counted, and the planner's count."""
    cfg, policy, reward, prompts = setup
    sets = [*SETS, "algorithm.shared_prefix=1", "algorithm.branch_tree=[[3, 2]]"]
    tree_cfg = load_config(None, sets)
    policy.cfg = tree_cfg
    rows, handle = counted_rows(policy)
    try:
        unit = scored(rollout_unit(policy, prompts, [0, 1], 0, cfg.train.seed), reward)
    finally:
        handle.remove()
        policy.cfg = cfg
    lat = unit.latents
    assert (lat[0, :4] - lat[1, :4]).abs().max() < 1e-5 and (lat[0, 4] - lat[1, 4]).abs().max() > 0.1
    assert (lat[0, :2] - lat[2, :2]).abs().max() < 1e-5 and (lat[0, 2] - lat[2, 2]).abs().max() > 0.1
    assert unit.train_idx.min() >= 1 and not unit.sde_mask[0] and unit.sde_mask[1:].all()
    from digenrl.planner.workload import Workload

    w = Workload.from_config(tree_cfg)
    assert w.rollout_widths() == [1, 2, 2, 4, 4, 4]
    assert sum(rows) / len(prompts) == 17 == w.rollout_forwards / w.prompts


def test_branchgrpo_depth_advantages_by_hand():
    """G = 4, prefix 1, split [3, 2] at 6 steps: steps 1-2 lead to 2 nodes (leaves 0-1, 2-3), steps 3-5
    to the 4 leaves. Group [1, 3, 2, 6]: nodes 2 and 4 -> -+1/sqrt(2); leaves: mean 3, sample std
    sqrt(14/3). A flat group is 0; a NaN leaf is left out of its node and of its depth, and is 0."""
    from digenrl.algorithms.grpo import group_advantages
    from digenrl.planner.workload import Workload
    from digenrl.units.advantages import depth_advantages, step_widths

    tree = load_config(None, [*SETS, "algorithm.shared_prefix=1", "algorithm.branch_tree=[[3, 2]]",
                              "algorithm.branch_advantages=depth"])  # fmt: skip
    widths = step_widths(tree)
    assert widths == [1, 2, 2, 4, 4, 4] == Workload.from_config(tree).rollout_widths()
    nan = float("nan")
    got = depth_advantages(torch.tensor([1.0, 3, 2, 6, 5, 5, 5, 5, 1, nan, 3, 3]), 4, widths)
    h, s4, s3 = 2**-0.5, (14 / 3) ** 0.5, (4 / 3) ** 0.5  # 2 nodes; 4 leaves; leaves 1, 3, 3
    m = 7 / 3  # the mean of leaves 1, 3, 3
    want = torch.tensor(
        [
            [0, -h, -h, *[-2 / s4] * 3], [0, -h, -h, *[0.0] * 3],
            [0, h, h, *[-1 / s4] * 3], [0, h, h, *[3 / s4] * 3],
            *[[0.0] * 6] * 4,
            [0, -h, -h, *[(1 - m) / s3] * 3], [0.0] * 6,
            [0, h, h, *[(3 - m) / s3] * 3], [0, h, h, *[(3 - m) / s3] * 3],
        ]
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # one split (no tree): every branched step's advantage is the group's, with the sample std
    one = load_config(None, [*SETS, "algorithm.shared_prefix=2", "algorithm.branch_advantages=depth"])
    r = torch.tensor([0.3, 0.9, 0.1, 0.5, 2.0, 1.0, 4.0, 3.0])
    flat = group_advantages(r, 4, clip=float("inf"), eps=1e-8, ddof=1)
    got = depth_advantages(r, 4, step_widths(one))
    assert got[:, :2].abs().max() == 0
    torch.testing.assert_close(got[:, 2:], flat[:, None].expand(-1, 4), rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="branch_advantages: depth needs a branched group"):
        load_config(None, [*SETS, "algorithm.branch_advantages=depth"])


@pytest.mark.slow
def test_a_branch_tree_trains_two_iterations_on_the_local_trainer(tmp_path, monkeypatch):
    import digenrl.units.train
    from digenrl.engine.local import LocalTrainer

    sets = [
        *SETS,
        *QUIET,
        "algorithm.shared_prefix=1",
        "algorithm.branch_tree=[[3, 2]]",
        "algorithm.branch_advantages=depth",
        "train.iterations=2",
    ]
    seen, term_loss = [], digenrl.units.train.term_loss

    def record(alg, logp, behaviour, adv, *args, **kwargs):  # the advantages each step's loss took
        seen.append(adv.abs())
        return term_loss(alg, logp, behaviour, adv, *args, **kwargs)

    monkeypatch.setattr(digenrl.units.train, "term_loss", record)
    result = LocalTrainer(load_config(None, sets)).run(tmp_path)
    assert len(result.metrics) == 2 and all(m["grad_norm"] > 0 for m in result.metrics)
    # BranchGRPO's per-depth advantages reach the loss: the 2-node steps of a group with distinct
    # nodes take exactly +-1/sqrt(2), which no 4-leaf standardisation gives every sample of a group
    assert any(torch.allclose(a, torch.full_like(a, 2**-0.5), atol=1e-5) for a in seen)
    # the leaves train their shared node's steps from the node's forward: ratio 1 to rounding
    assert abs(result.metrics[0]["ratio_mean"] - 1) < 1e-5


@pytest.mark.parametrize(
    "sets",
    [
        ["algorithm.shared_prefix=6"],  # no step left to branch in
        ["algorithm.branch_tree=[[3, 2]]"],  # a tree without a prefix
        ["algorithm.shared_prefix=3", "algorithm.branch_tree=[[2, 2]]"],  # a split before the prefix's
        ["algorithm.shared_prefix=1", "algorithm.branch_tree=[[3, 3]]"],  # 3 does not divide G = 4
        ["algorithm.shared_prefix=1", "algorithm.branch_tree=[[3, 4]]"],  # one first branch only
        ["algorithm.shared_prefix=2", "algorithm.timesteps.mode=random"],
        ["algorithm.shared_prefix=2", "sampling.noise_level=0"],
        [
            "algorithm.shared_prefix=2",
            "algorithm.timesteps.mode=window",
            "algorithm.timesteps.window_range=[0,0.5]",
        ],
    ],
)
def test_a_prefix_without_stochastic_steps_after_it_is_refused(sets):
    with pytest.raises(ConfigError, match="shared_prefix|branch_tree"):
        load_config(None, [*SETS, *sets])


@pytest.mark.slow
def test_engine_timeline_invariants_hold_with_a_shared_prefix(ray_cluster, tmp_path):
    from digenrl.engine.timeline import Timeline
    from digenrl.launch import run_engine
    from tests.helpers import FULL_MODE, assert_timeline_invariants

    cfg = load_config(
        None,
        [*TINY, *QUIET, *FULL_MODE, "sampling.steps=6", "algorithm.shared_prefix=2", "train.iterations=2"],
    )
    result = run_engine(cfg, run_dir=tmp_path)
    assert_timeline_invariants(cfg, Timeline.from_chrome_trace(tmp_path / "timeline.json"))
    assert len(result.metrics) == 2 and all(m["grad_norm"] > 0 for m in result.metrics)


@pytest.mark.slow
def test_the_planner_search_offers_the_prefix_as_a_knob():
    """FLUX.1-dev at 8 steps on 4 x H200: a 2-step shared prefix saves (G - 1) x 2 forwards per group,
    and the best plan's simulated throughput rises with it. The KL reference stays on the trainer in
    both (algorithm.kl_reference train: a branched group cannot compute it at rollout, so with auto
    the prefix would also move it back; test_prefix_moves_the_kl_reference_back checks that part)."""
    from pathlib import Path

    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.gpus import load_cluster
    from digenrl.planner.prefix_search import search_shared_prefix
    from digenrl.planner.workload import Workload

    root = Path(__file__).resolve().parents[1]
    sets = ["sampling.steps=8", "algorithm.kl_reference=train"]
    w = Workload.from_config(load_config(root / "configs" / "flux1_dev.yaml", sets))
    cluster = load_cluster(root / "configs" / "clusters" / "4xH200.yaml")
    found = search_shared_prefix(CostModel(w, cluster), cluster, prefixes=(0, 2, 8), iterations=2, top=2)
    assert set(found) == {0, 2}  # a prefix of every step leaves nothing to branch: not offered
    assert found[2].ranked[0].samples_per_s > found[0].ranked[0].samples_per_s
