"""Mini-batch PPO (``train.optimizer_steps``) in the local trainer: the first mini-batch is on-policy
(ratio 1 up to fp32 rounding, nothing clipped), the later ones see the moved weights (ratio off 1,
the clip binds), and one step per iteration is today's update bit for bit."""

import pytest
import torch

from digenrl.config import load_config
from digenrl.trainer import LocalTrainer
from digenrl.units import assign_advantages, merge_stats, minibatch_rows, train_unit

SMALL = ["placement.mode=local", "model.height=16", "model.width=16", "algorithm.group_size=4", "sampling.steps=4",
         "train.prompts_per_iteration=4", "output.tensorboard=false", "train.lr=1e-2"]


def trainer_of(*overrides) -> LocalTrainer:
    return LocalTrainer(load_config(None, [*SMALL, *overrides]))


def test_first_minibatch_has_ratio_one_and_later_ones_clip():
    t = trainer_of("train.optimizer_steps=4")
    units = t.rollout(0)
    assign_advantages(units, t.cfg)
    per_step = []
    terms = sum(len(u) * u.train_idx.shape[1] for u in units) // 4
    for s in range(4):
        parts = [train_unit(t.policy, u, terms, minibatch=s, minibatches=4) for u in units]
        assert sum(p["terms"] for p in parts) == terms  # a quarter of the iteration's terms
        per_step.append(merge_stats(parts))
        t.policy.optimizer_step(publish=s == 3)
    first, later = per_step[0], per_step[1:]
    # on-policy: the recomputed log-prob is the behaviour log-prob up to fp32 rounding (the slice is
    # recomputed in other batch shapes than the rollout's), far inside the clip: nothing clipped
    assert abs(first["ratio_min"] - 1) < 1e-6 and abs(first["ratio_max"] - 1) < 1e-6 and first["clip_frac"] == 0.0
    for st in later:  # PPO: the ratio to the behaviour policy moves and the clip (1e-4) binds
        assert st["clip_frac"] > 0
        assert st["ratio_max"] > 1 + 1e-4 and st["ratio_min"] < 1 - 1e-4
    assert t.policy.version == 1  # four steps, one iteration, one version


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
    assert st["is_weight_mean"] != pytest.approx(1.0, abs=1e-6) and st["is_weight_max"] <= t.cfg.algorithm.is_cap


def test_minibatch_rows_slice_every_group():
    rows = [minibatch_rows(12, 4, s, 2).tolist() for s in range(2)]
    assert rows == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    assert minibatch_rows(8, 4, 0, 1).tolist() == list(range(8))
    # a sub-group unit: samples 2..3 of one group of 4 belong to mini-batch 1 of 2
    assert minibatch_rows(2, 4, 1, 2, per_group=2, first=2).tolist() == [0, 1]
    assert minibatch_rows(2, 4, 0, 2, per_group=2, first=2).tolist() == []


def test_optimizer_steps_must_divide_the_group_size():
    from digenrl.config import ConfigError

    with pytest.raises(ConfigError, match="train.optimizer_steps \\(3\\) must divide algorithm.group_size \\(4\\)"):
        load_config(None, [*SMALL, "train.optimizer_steps=3"])
