"""``engine.rollout_batch``: a rollout-only worker samples at its own batch. ``trainer`` (and ``auto`` on
a device of unknown memory) keeps the train forwards' batches and the on-policy ratio exactly 1; any
other batch makes the ratio 1 to rounding, and ``logprob_mismatch`` says by how much. Resolved once
into the layout; TAG ranks and colocated workers keep the trainer's batches; ``plan --write`` writes
the batch the cost model assumed, never the trainer's micro-batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from digenrl.config.run import load_config
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.placement.layout import RunLayout
from digenrl.placement.resolve import resolve
from digenrl.policy.model import Policy
from digenrl.rewards import build_reward
from digenrl.units.advantages import assign_advantages
from digenrl.units.rollout import rollout_unit, scored
from digenrl.units.train import merge_stats, train_unit
from tests.helpers import FULL_MODE, TINY

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    *FULL_MODE,
    *TINY,
    "train.micro_batch=1",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
    "output.tensorboard=false",
]
H800 = ["cluster.pools=[{name: rollout, device: H800, count: 2}, {name: trainer, device: H800, count: 2}]"]


def on_policy_stats(batch: int | None) -> dict:
    """Roll out a unit of two groups (8 samples) at ``batch`` samples per forward (None: the trainer's
    batches), then recompute every log-prob as a trainer rank does (micro-batch 1)."""
    cfg = load_config(None, SMALL)
    torch.manual_seed(cfg.train.seed)
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(0, 2)
    policy, reward = Policy(cfg), build_reward(cfg.reward)
    unit = scored(rollout_unit(policy, prompts, [0, 1], 0, cfg.train.seed, batch=batch), reward)
    assign_advantages([unit], cfg)
    return merge_stats([train_unit(policy, unit, len(unit) * unit.train_idx.shape[1])])


def test_trainer_batches_give_a_ratio_of_exactly_one_and_an_own_batch_one_to_rounding():
    exact = on_policy_stats(None)
    assert exact["logprob_mismatch"] == 0.0 and exact["ratio_min"] == exact["ratio_max"] == 1.0
    own = on_policy_stats(3)  # forwards of 3, 3, 2 samples, recomputed one sample at a time
    assert 0.0 < own["logprob_mismatch"] < 1e-4  # measured: 2.5e-9 (fp32 CPU)
    assert abs(own["ratio_min"] - 1) < 1e-4 and abs(own["ratio_max"] - 1) < 1e-4


def test_the_layout_holds_the_rollout_batch_and_only_rollout_workers_use_it():
    auto_cpu = resolve(load_config(None, SMALL))  # CPU pools: memory unknown, auto is the trainer's batches
    assert auto_cpu.settings.rollout_batch is None
    fixed = resolve(load_config(None, [*SMALL, "engine.rollout_batch=3"]))
    assert fixed.settings.rollout_batch == 3
    assert fixed.settings.sampling_batch("rollout") == 3
    assert fixed.settings.sampling_batch("trainer") is None  # a TAG rank keeps the trainer's batches
    assert RunLayout.from_dict(json.loads(json.dumps(fixed.to_dict()))).settings == fixed.settings
    assert any("rollout batch 3" in line for line in fixed.describe())
    colocated = resolve(load_config(None, [*SMALL, "placement.mode=colocated", "engine.rollout_batch=3"]))
    assert colocated.settings.rollout_batch is None  # no rollout-only worker
    pinned = resolve(load_config(None, [*SMALL, *H800, "engine.rollout_batch=trainer"]))
    assert pinned.settings.rollout_batch is None


def test_auto_on_a_known_gpu_is_the_largest_batch_its_memory_holds():
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.params import CostParams
    from digenrl.planner.workload import Workload

    cfg = load_config(None, [*SMALL, *H800])
    layout = resolve(cfg)
    assert layout.settings.rollout_batch == 4  # the tiny FLUX: a whole unit fits an H800
    qwen = load_config(ROOT / "configs" / "qwen_image.yaml")
    model = MemoryModel(Workload.from_config(qwen), CostParams())
    samples = qwen.engine.unit_groups * qwen.algorithm.group_size
    for device in ("H800", "RTX4090"):
        b = model.rollout_batch(device, qwen.engine.unit_groups)
        assert 1 <= b <= samples
        assert b == 1 or model.rollout(device, qwen.engine.unit_groups, batch=b).fits
        if b < samples:  # one more would not fit
            assert not model.rollout(device, qwen.engine.unit_groups, batch=b + 1).fits
    # a forward's activations grow with its batch; the unit's trajectory does not
    small, large = (model.rollout_parts(1, batch=b)["activations"] for b in (1, 8))
    assert small < large <= model.rollout_parts(1)["activations"] or qwen.algorithm.group_size < 8


@pytest.mark.parametrize("value, error", [(0, "engine.rollout_batch"), ("big", "engine.rollout_batch")])
def test_a_bad_rollout_batch_names_the_field(value, error):
    from digenrl.errors import UserError

    with pytest.raises(UserError, match=error):
        load_config(None, [f"engine.rollout_batch={value}"])


@pytest.mark.slow  # seconds of planner search or model timing: the full suite runs it
def test_plan_write_writes_the_rollout_batch_the_cost_model_assumed(tmp_path, monkeypatch, capsys):
    """The rollout devices were timed at their own batch (never the trainer's memory-forced micro-batch):
    that batch is what the written config runs, and its layout says so."""
    from helpers import cli

    out = tmp_path / "plan.yaml"
    code, stdout, err = cli(
        monkeypatch,
        capsys,
        "plan",
        "-c",
        str(ROOT / "configs" / "qwen_image.yaml"),
        "--cluster",
        str(ROOT / "configs" / "clusters" / "8xH800_16xH20.yaml"),
        "--json",
        "--top",
        "1",
        "--write",
        str(out),
    )
    assert code == 0, err
    plan = json.loads(stdout)["plans"][0]
    written = yaml.safe_load(out.read_text())
    layout = json.loads(out.with_suffix(".layout.json").read_text())
    assert plan["placement"] == written["placement"]["mode"] == "disaggregated", plan["plan"]
    batch = written["engine"]["rollout_batch"]
    assert isinstance(batch, int) and batch > written["train"]["micro_batch"]  # its own, not the trainer's
    assert layout["settings"]["rollout_batch"] == batch
