"""Mini-batch PPO (``train.optimizer_steps``) in the local trainer: the first mini-batch is on-policy
(ratio exactly 1, nothing clipped), the later ones see the moved weights (ratio off 1, the clip
binds), and one step per iteration is today's update bit for bit."""

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.engine.local import LocalTrainer
from digenrl.units.advantages import assign_advantages
from digenrl.units.rows import minibatch_rows
from digenrl.units.train import merge_stats, train_unit
from tests.helpers import TINY, TINY_IMAGE

SMALL = [
    *TINY,
    "placement.mode=local",
    "train.prompts_per_iteration=4",
    "output.tensorboard=false",
    "train.lr=1e-2",
]


def trainer_of(*overrides) -> LocalTrainer:
    return LocalTrainer(load_config(None, [*SMALL, *overrides]))


def minibatch_stats(t: LocalTrainer, iteration: int, steps: int) -> list[dict]:
    """Iteration ``iteration`` trained by hand, one mini-batch at a time: each mini-batch's stats."""
    units = t.rollout(iteration)
    assign_advantages(units, t.cfg)
    terms = sum(len(u) * u.train_idx.shape[1] for u in units) // steps
    out = []
    for s in range(steps):
        parts = [train_unit(t.policy, u, terms, minibatch=s, minibatches=steps) for u in units]
        assert sum(p["terms"] for p in parts) == terms  # a 1/steps share of the iteration's terms
        out.append(merge_stats(parts))
        t.policy.optimizer_step(publish=s == steps - 1)
    return out


def test_first_minibatch_has_ratio_exactly_one_and_later_ones_clip():
    t = trainer_of("train.optimizer_steps=4")
    t.iteration(0)  # LoRA moved off its zero init: the check below runs on trained weights
    first, *later = minibatch_stats(t, 1, 4)
    # on-policy: the trainer forwards each sample in the batch the rollout forwarded it in, so the
    # recomputed log-prob IS the behaviour log-prob, bit for bit: the ratio is exactly 1
    assert first["logprob_mismatch"] == 0.0
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["clip_frac"] == 0.0
    for st in later:  # PPO: the ratio to the behaviour policy moves and the clip (1e-4) binds
        assert st["clip_frac"] > 0
        assert st["ratio_max"] > 1 + 1e-4 and st["ratio_min"] < 1 - 1e-4
        assert "logprob_mismatch" not in st  # measured on the on-policy mini-batch only
    assert t.policy.version == 2  # four steps per iteration, one version per iteration


@pytest.mark.parametrize(
    "config, overrides",
    [
        (None, ["train.micro_batch=1", "train.prompts_per_iteration=2"]),  # one sample per forward
        (None, ["train.micro_batch=3"]),  # micro-batches that straddle groups
        (None, ["algorithm.timesteps.mode=window", "algorithm.timesteps.window=2"]),
        (None, ["algorithm.name=dance_grpo", "sampling.steps=8"]),  # random steps: each step's samples apart
        ("configs/qwen_tiny.yaml", [*TINY_IMAGE, "train.prompts_per_iteration=2"]),
        (
            "configs/qwen_tiny.yaml",
            [
                *TINY_IMAGE,
                "train.prompts_per_iteration=2",
                "sampling.cfg_batching=sequential",
            ],
        ),  # trained one CFG pass at a time
        (
            "configs/qwen_tiny.yaml",
            [
                *TINY_IMAGE,
                "train.prompts_per_iteration=2",
                "sampling.cfg_batching=batched",
            ],
        ),  # both passes in one forward of 2B
    ],
    ids=[
        "micro1",
        "micro3",
        "window",
        "dance_grpo",
        "qwen_image",
        "qwen_image-cfg-sequential",
        "qwen_image-cfg-batched",
    ],
)
def test_on_policy_ratio_is_exactly_one_in_every_batch_layout(config, overrides):
    """Micro-batches, window and random steps, another family (two-pass CFG): mini-batch 0 of 2
    reproduces the rollout's log-probs exactly."""
    t = LocalTrainer(load_config(config, [*SMALL, "train.optimizer_steps=2", *overrides]))
    first, second = minibatch_stats(t, 0, 2)
    assert first["logprob_mismatch"] == 0.0 and first["ratio_min"] == first["ratio_max"] == 1.0
    assert second["ratio_max"] > 1 or second["ratio_min"] < 1


def test_on_policy_ratio_is_exactly_one_on_every_tsp_rank():
    """In the engine a unit's trained steps are split over TSP ranks; the rollout forwards each
    rank's samples of a step apart (random steps, two ranks, as a trainer rank runs them)."""
    from digenrl.data.prompts import PromptSampler, load_prompts
    from digenrl.policy.model import Policy
    from digenrl.rewards import build_reward
    from digenrl.units.rollout import rollout_unit, scored

    cfg = load_config(
        None,
        [
            *SMALL,
            "placement.mode=colocated",
            "engine.max_staleness=0",
            "engine.tsp_degree=2",
            "algorithm.name=dance_grpo",
            "sampling.steps=8",
            "train.optimizer_steps=2",
            "train.prompts_per_iteration=2",
        ],
    )
    torch.manual_seed(cfg.train.seed)
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(0, 2)
    policy, reward = Policy(cfg), build_reward(cfg.reward)
    units = [
        scored(rollout_unit(policy, prompts[j : j + 1], [j], 0, cfg.train.seed), reward) for j in range(2)
    ]
    assign_advantages(units, cfg)
    terms = sum(len(u) * u.train_idx.shape[1] for u in units) // 2
    parts = [
        train_unit(policy, u, terms, rank, 2, minibatch=0, minibatches=2) for u in units for rank in range(2)
    ]
    assert sum(p["terms"] for p in parts) == terms and all(p["terms"] for p in parts)
    st = merge_stats(parts)
    assert st["logprob_mismatch"] == 0.0 and st["ratio_min"] == st["ratio_max"] == 1.0


def test_a_rollout_in_one_batch_gives_a_ratio_of_one_only_to_rounding(monkeypatch):
    """The control: forwarding the whole unit at once (what rollouts did before) leaves the
    trainer's recomputation of mini-batch 0 off the behaviour log-prob by fp32 rounding."""
    import digenrl.units.rollout

    monkeypatch.setattr(digenrl.units.rollout, "forward_batches", lambda *args, **kwargs: None)
    t = trainer_of("train.optimizer_steps=4")
    first, *_ = minibatch_stats(t, 0, 4)
    assert 0.0 < first["logprob_mismatch"] < 1e-5
    assert (
        abs(first["ratio_min"] - 1) < 1e-5
        and abs(first["ratio_max"] - 1) < 1e-5
        and first["clip_frac"] == 0.0
    )


def test_iteration_metrics_with_four_steps():
    t = trainer_of("train.optimizer_steps=4")
    row = t.iteration(0)
    assert row["version"] == 1 and t.policy.version == 1
    assert row["clip_frac"] > 0 and row["ratio_max"] > 1 and row["ratio_min"] < 1


def test_one_step_per_iteration_is_the_full_batch_update_bit_for_bit():
    """optimizer_steps 1 (the default): the iteration is one step over every unit, as before mini-batches."""
    t, ref = trainer_of(), trainer_of()
    assert t.cfg.train.optimizer_steps == 1
    for it in range(2):
        row = t.iteration(it)
        units = ref.rollout(it)
        assign_advantages(units, ref.cfg)
        total = sum(len(u) * u.train_idx.shape[1] for u in units)
        stats = merge_stats([train_unit(ref.policy, u, total) for u in units])
        stats["grad_norm"] = ref.policy.optimizer_step()
        assert row["loss"] == stats["loss"] and row["grad_norm"] == stats["grad_norm"]
        assert row["ratio_mean"] == stats["ratio_mean"] and row["clip_frac"] == stats["clip_frac"]
    for a, b in zip(t.policy.params, ref.policy.params):
        assert torch.equal(a, b)


def test_stale_samples_clip_around_the_weights_at_the_start_of_the_minibatch():
    """Decoupled PPO: samples of an older version are clipped around the proximal policy, the
    weights at the start of the current mini-batch (ratio exactly 1 there), and weighted by
    exp(logp_proximal - logp_behaviour), capped."""
    t = trainer_of("train.optimizer_steps=2")
    units = t.rollout(0)
    assign_advantages(units, t.cfg)
    t.iteration(0)  # version 1, two steps later: the samples of version 0 are stale
    terms = sum(len(u) * u.train_idx.shape[1] for u in units)
    st = merge_stats([train_unit(t.policy, u, terms) for u in units])
    assert st["ratio_min"] == st["ratio_max"] == 1.0
    assert (
        st["is_weight_mean"] != pytest.approx(1.0, abs=1e-6) and st["is_weight_max"] <= t.cfg.algorithm.is_cap
    )


def test_minibatch_rows_slice_every_group():
    rows = [minibatch_rows(12, 4, s, 2).tolist() for s in range(2)]
    assert rows == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    assert minibatch_rows(8, 4, 0, 1).tolist() == list(range(8))
    # a sub-group unit: samples 2..3 of one group of 4 belong to mini-batch 1 of 2
    assert minibatch_rows(2, 4, 1, 2, per_group=2, first=2).tolist() == [0, 1]
    assert minibatch_rows(2, 4, 0, 2, per_group=2, first=2).tolist() == []


def test_optimizer_steps_must_divide_the_group_size():
    from digenrl.config.base import ConfigError

    with pytest.raises(
        ConfigError, match="train.optimizer_steps \\(3\\) must divide algorithm.group_size \\(4\\)"
    ):
        load_config(None, [*SMALL, "train.optimizer_steps=3"])
