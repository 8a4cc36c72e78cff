"""`digenrl profile` on the tiny presets of every family (fast settings), and the profile feeding the
cost model. No timing is asserted beyond "positive": the numbers belong to benchmarks/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from digenrl.cli.app import app
from digenrl.config.engine import PoolConfig
from digenrl.config.run import load_config
from digenrl.errors import UserError
from digenrl.placement.plan import Plan
from digenrl.planner.call_times import ProfiledTimes
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import load_cluster
from digenrl.planner.profile import batch_sizes, load_profile, run_profile, save_profile
from digenrl.planner.simulator import simulate
from digenrl.planner.workload import Workload
from tests.helpers import FULL_MODE

#: tests.helpers.FULL_MODE as the YAML of a run config file (the knobs the default run leaves off)
FULL_MODE_YAML = (
    "placement: {mode: disaggregated}\nengine: {gap: true, tag: true, tsp_degree: 2, max_staleness: 1}\n"
)

ROOT = Path(__file__).resolve().parents[1]
FAST = ["sampling.steps=2", "train.prompts_per_iteration=2", "algorithm.group_size=2", "train.micro_batch=2"]


def fast_profile(cfg, **kw):
    return run_profile(cfg, "cpu", batches=[1, 2], repeats=1, warmup=0, min_time=0.0, **kw)


@pytest.mark.parametrize("family", ["flux", "wan", "hunyuan", "qwen"])
def test_profile_each_tiny_family(family, tmp_path):
    cfg = load_config(ROOT / "configs" / f"{family}_tiny.yaml", FAST)
    profile = fast_profile(cfg, sharing=0)
    m, w = profile["measurements"], profile["workload"]
    assert profile["device"]["kind"] == "cpu" and profile["torch"]
    assert profile["model"]["class"].endswith("Model") and profile["model"]["params"] > 0
    assert w["steps"] == 2 and w["group_size"] == 2
    assert w["guidance_passes"] == (2 if family in ("wan", "qwen") else 1)
    rollout_b, train_b = batch_sizes(cfg, [1, 2])
    assert set(map(int, m["rollout_step_s"])) == set(rollout_b) and set(map(int, m["train_step_s"])) == set(
        train_b
    )
    assert all(v > 0 for v in m["rollout_step_s"].values()) and all(v > 0 for v in m["train_step_s"].values())
    for key in ("decode_s_per_sample", "reward_s_per_sample", "encode_s_per_prompt", "optimizer_step_s"):
        assert m[key] > 0, key
    lora = Workload.from_config(cfg).params.lora
    assert m["weight_sync"]["bytes"] == 4 * lora  # LoRA tensors in fp32
    assert m["weight_sync"]["pack_s"] > 0 and m["weight_sync"]["load_s"] > 0
    assert m["unit_overhead"]["rollout_unit_s"] > 0 and m["peak_memory_bytes"]["train"] > 0
    assert set(m["unit_cv"]) == {"rollout", "train"} and all(v >= 0 for v in m["unit_cv"].values())
    # it round-trips through profile.json and calibrates the cost model of the same model
    path = save_profile(profile, tmp_path / "profile.json")
    again = load_profile(path)
    cost = CostModel(
        Workload.from_config(cfg),
        load_cluster(ROOT / "configs" / "clusters" / "local_cpu.yaml"),
        profile=again,
    )
    assert isinstance(cost.times("cpu"), ProfiledTimes)
    assert cost.rollout_unit("cpu", 1)[0] > 0 and cost.train_unit("cpu", 1, 0, 1) > 0
    plan = Plan(
        placement="disaggregated",
        pools=(PoolConfig(name="rollout", device="cpu"), PoolConfig(name="trainer", device="cpu")),
    )
    assert simulate(plan, cost).samples_per_s > 0


@pytest.mark.slow
def test_profile_measures_cpu_sharing():
    cfg = load_config(None, FULL_MODE + FAST)
    slow = fast_profile(cfg, sharing=2)["measurements"]["cpu_slowdown"]
    assert slow["1"] == 1.0 and slow["2"] > 0.5


def test_profile_of_another_model_is_refused(tmp_path):
    cfg = load_config(None, FULL_MODE + FAST)
    path = save_profile(fast_profile(cfg, sharing=0), tmp_path / "flux.json")
    wan = load_config(ROOT / "configs" / "wan_tiny.yaml", FAST)
    with pytest.raises(UserError, match="measured on FluxTransformer2DModel"):
        CostModel(
            Workload.from_config(wan),
            load_cluster(ROOT / "configs" / "clusters" / "local_cpu.yaml"),
            profile=load_profile(path),
        )
    bigger = load_config(None, FULL_MODE + FAST + ["model.height=64", "model.width=64"])
    with pytest.raises(UserError, match="tokens per sample"):
        CostModel(
            Workload.from_config(bigger),
            load_cluster(ROOT / "configs" / "clusters" / "local_cpu.yaml"),
            profile=load_profile(path),
        )
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(UserError, match="not a digenrl profile"):
        load_profile(tmp_path / "junk.json")


@pytest.mark.slow
def test_profile_cli_writes_json_and_prints_a_table(tmp_path):
    cfg_file = tmp_path / "small.yaml"
    cfg_file.write_text(
        "sampling: {steps: 2}\nalgorithm: {group_size: 2}\ntrain: {prompts_per_iteration: 2, "
        "micro_batch: 2}\n" + FULL_MODE_YAML
    )
    out = tmp_path / "p" / "profile.json"
    cmd = ["profile", "--config", str(cfg_file), "--out", str(out), "--cpu-sharing", "2"]
    result = CliRunner().invoke(app, cmd)
    assert result.exit_code == 0, result.output
    assert "rollout step" in result.output and "engine: call round trip" in result.output
    data = json.loads(out.read_text())
    assert set(data["measurements"]["cpu_slowdown"]) == {"1", "2"}  # probed up to --cpu-sharing
    assert data["engine"]["call_s"] > 0 and data["engine"]["transfer_bytes_per_s"] > 0
    # and `digenrl plan` takes it
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--config",
            str(cfg_file),
            "--cluster",
            str(ROOT / "configs" / "clusters" / "local_cpu.yaml"),
            "--profile",
            str(out),
            "--json",
            "--top",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["cost_model"]["times"]["cpu"].startswith("profile")


def test_profile_of_a_missing_checkpoint_exits_2():
    result = CliRunner().invoke(app, ["profile", "--config", str(ROOT / "configs" / "flux1_dev.yaml")])
    assert isinstance(result.exception, UserError) and result.exception.exit_code == 2
    assert "model.pretrained" in str(result.exception)


def test_whole_unit_factor_scales_every_composed_unit_and_tsp_shares_split_it(tmp_path):
    """A profile's unit factor (whole unit / its calls, measured at the run's unit size) multiplies
    every composed unit: a TSP share of a train unit costs its share of the overhead, not all of it."""
    cfg = load_config(None, FULL_MODE + FAST + ["engine.unit_groups=1", "sampling.steps=6"])
    profile = fast_profile(cfg, sharing=0)
    u = profile["measurements"]["unit_overhead"]
    assert u["groups"] == 1 and u["rollout_factor"] > 0 and u["train_factor"] > 0
    cluster = load_cluster(ROOT / "configs" / "clusters" / "local_cpu.yaml")
    w = Workload.from_config(cfg)

    def with_train_factor(factor: float) -> dict:
        # (pinned: a factor measured on a busy machine can fall under the floor, MIN_UNIT_FRACTION,
        # where doubling it no longer doubles the unit -- seen once in a full suite run)
        overhead = {**u, "train_factor": factor}
        return {**profile, "measurements": {**profile["measurements"], "unit_overhead": overhead}}

    base = CostModel(w, cluster, profile=with_train_factor(1.5))
    slow = CostModel(w, cluster, profile=with_train_factor(3.0))
    assert slow.train_unit("cpu", 1, 0, 1) == pytest.approx(2 * base.train_unit("cpu", 1, 0, 1))
    # the TSP shares of a unit add up to the unit (overhead included), each in proportion to its positions
    for D in (2, 3):
        shares = [base.train_unit("cpu", 1, r, D) for r in range(D)]
        assert sum(shares) == pytest.approx(base.train_unit("cpu", 1, 0, 1))
        assert shares[0] == pytest.approx(
            base.train_unit("cpu", 1, 0, 1) * w.positions(0, D) / w.trained_steps
        )


def test_engine_unit_factor_is_taken_against_the_reference_units():
    from digenrl.engine.timeline import Timeline
    from digenrl.planner.measure.engine_run import unit_time_factors

    tl = Timeline()
    tl.add_worker("rollout0", "rollout")
    tl.add_worker("trainer0", "trainer")
    for k in range(3):  # iteration 0 (warm-up) is left out
        d = 0.5 if k == 0 else 0.12
        tl.record("rollout0", "rollout", f"r{k}", k, k, k, k + d)
        tl.record("trainer0", "train", f"t{k}", k, k, k + d, k + 2 * d)
    factors = unit_time_factors(tl, load_config(None, FULL_MODE + FAST), {}, {"rollout": 0.1, "train": 0.1})
    assert factors == pytest.approx({"rollout": 1.2, "train": 1.2})


def test_unit_spread_counts_jitter_not_drift():
    import random
    import statistics

    from digenrl.planner.measure.engine_run import unit_spread

    drift = [1.0 + 0.01 * i for i in range(50)]  # the host slowing down steadily: no wait at a barrier
    assert unit_spread([drift]) < 0.01 < statistics.pstdev(drift) / statistics.fmean(drift)
    rng = random.Random(0)
    jitter = [[rng.gauss(2.0, 0.2) for _ in range(1000)] for _ in range(2)]
    assert unit_spread(jitter) == pytest.approx(0.1, rel=0.1)
    assert unit_spread([[1.0], []]) == 0.0  # no successive pair


@pytest.mark.slow
def test_other_load_counts_our_children_as_ours():
    import os
    import subprocess
    import sys
    import time

    from digenrl.planner.measure.contention import OtherLoad

    spin = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"],
        start_new_session=True,
    )

    def cpu_s() -> float:  # the child's CPU seconds so far (utime + stime)
        fields = open(f"/proc/{spin.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    try:
        time.sleep(0.3)
        before = cpu_s()
        with OtherLoad(every=0.2) as load:  # a child of ours: not "other"
            time.sleep(1.2)
        spun = cpu_s() - before
    finally:
        spin.wait()
    # the spinning child is ours (we started it): the CPU it got (whatever the host's load let it have)
    # is counted as ours, within the sampling's granularity
    assert load.seconds > 0.8 and spun > 0
    assert load.ours * load.seconds >= 0.6 * spun, (load.ours, load.seconds, spun)


@pytest.mark.slow
def test_profile_cli_engine_none_measures_the_model_only(monkeypatch, capsys, tmp_path):
    from helpers import cli

    cfg_file = tmp_path / "small.yaml"
    cfg_file.write_text(
        "sampling: {steps: 2}\nalgorithm: {group_size: 2}\ntrain: {prompts_per_iteration: 2, "
        "micro_batch: 2}\n" + FULL_MODE_YAML
    )
    out = tmp_path / "profile.json"
    code, stdout, err = cli(
        monkeypatch,
        capsys,
        "profile",
        "--config",
        str(cfg_file),
        "--out",
        str(out),
        "--engine",
        "none",
        "--repeats",
        "1",
        "--cpu-sharing",
        "0",
    )
    assert code in (0, None), err
    data = json.loads(out.read_text())
    assert data["engine"] is None and "engine: call round trip" not in stdout
    assert "cpu_slowdown" not in data["measurements"]  # --cpu-sharing 0: not probed (the other test does)
    assert data["measurements"]["timing_rounds"] >= 1 and "other_load_cores" in data["measurements"]


def test_gpu_profile_calibrates_the_efficiency_curve_from_the_batches_both_tables_measured():
    """A GPU profile's rollout table has unit batches (m x G) the train table does not: the kernel
    efficiency curve ``peak n / (n + half)`` is fitted at the batches both measured, so a profile at
    several batch sizes recovers the curve its times came from (and a batch only one table has is
    left out)."""
    from digenrl.placement.devices import DEVICES
    from digenrl.planner.shapes import attention_fraction, forward_flops

    cfg = load_config(None, FULL_MODE + FAST)
    w = Workload.from_config(cfg)
    peak, flops = DEVICES["H100"].bf16_flops, forward_flops(w.shape) * w.passes
    train_factor = 2.0 + attention_fraction(w.shape)  # forward + LoRA backward
    per = (w.shape.tokens.x + w.shape.tokens.text) * w.passes

    def curve(top, half):
        return lambda b: top * b * per / (b * per + half)

    roll, train = curve(0.5, 3.0 * per), curve(0.4, 1.5 * per)
    profile = {
        "device": {"kind": "gpu", "name": "NVIDIA H100 80GB HBM3", "table_key": "H100"},
        "model": w.shape.signature(),
        "workload": {"tokens": {"x": w.shape.tokens.x, "text": w.shape.tokens.text}},
        "measurements": {
            "rollout_step_s": {str(b): b * flops / (roll(b) * peak) for b in (1, 4, 8)}
            | {"32": 32 * flops / (0.01 * peak)},  # only in the rollout table: not fitted
            "train_step_s": {str(b): b * flops * train_factor / (train(b) * peak) for b in (1, 4, 8)},
        },
    }
    cost = CostModel(w, load_cluster(ROOT / "configs" / "clusters" / "16xH800.yaml"), profile=profile)
    p = cost.params
    assert p.mfu_rollout == pytest.approx(0.5) and p.mfu_half_tokens_rollout == pytest.approx(3.0 * per)
    assert p.mfu_train == pytest.approx(0.4) and p.mfu_half_tokens_train == pytest.approx(1.5 * per)
    assert cost.params.mfu_source == "calibrated on NVIDIA H100 80GB HBM3"
