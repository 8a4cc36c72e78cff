"""A sharded (FSDP2) trainer group as one SPMD unit beside the engine's other features: it assists
generation (TAG: every rank generates its share of the unit, parameters gathered per forward as in
training), trains TSP shares, and trains DanceGRPO's random timesteps in lockstep (every rank runs
the group's union of trained steps). On-policy each run equals the single-process trainer, and the
timeline invariants of docs/architecture.md hold (tests/helpers.assert_timeline_invariants)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from tests.helpers import TINY, assert_timeline_invariants  # noqa: E402

pytestmark = pytest.mark.slow

BASE = [
    *TINY,
    "train.iterations=2",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
]
FSDP = [
    "placement.mode=disaggregated",
    "engine.gap=true",
    "train.fsdp=2",
    "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
]
RANDOM = ["algorithm.timesteps.mode=random", "algorithm.timesteps.fraction=0.5"]
CASES = {
    # the group takes rollout units before its first step (TAG): each rank generates one of the two
    # groups, at its own sampling batch (engine.colocated_batch 1: forwards of 1 sample per share)
    "tag": (["engine.tag=true", "engine.colocated_batch=1"], []),
    # two TSP shares of every unit, both trained by the one sharded group
    "tsp": (["engine.tag=false", "engine.tsp_degree=2"], []),
    # DanceGRPO's random trained steps: the ranks' samples train different steps, run in lockstep; the
    # group's TAG elastic (BTS)
    "random_timesteps": (["engine.tag=auto"] + RANDOM, RANDOM),
    # a unit of 3 samples over 2 ranks (2 + 1): the rank with one micro-batch fewer runs the other's
    # passes zero-weighted (train.micro_batch 1), and the TAG units are generated whole on both ranks
    "uneven_split": (
        ["engine.tag=true", "algorithm.group_size=3", "train.micro_batch=1"] + RANDOM,
        ["algorithm.group_size=3", "train.micro_batch=1"] + RANDOM,
    ),
}


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


@pytest.mark.parametrize("case", CASES)
def test_sharded_group_beside_tag_tsp_and_random_timesteps(cluster, tmp_path, case):
    sets, local_sets = CASES[case]
    ref = LocalTrainer(load_config(None, BASE + local_sets)).run(tmp_path / "local")
    cfg = load_config(None, BASE + FSDP + sets)
    result = run_engine(cfg, run_dir=tmp_path / "fsdp")
    want = load_file(tmp_path / "local" / "final" / "pytorch_lora_weights.safetensors")
    got = load_file(tmp_path / "fsdp" / "final" / "pytorch_lora_weights.safetensors")
    assert got.keys() == want.keys()
    for k in want:  # the tolerance of test_engine_fsdp (gradients summed in another order, then Adam)
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
    tl = Timeline.from_chrome_trace(tmp_path / "fsdp" / "timeline.json")
    assert_timeline_invariants(cfg, tl)
    assert {t.worker for t in tl.of("train")} == {"trainer0"}  # the group's lead, for both ranks
    if "engine.tag=true" in sets:  # the group generated (a unit before the first step)
        assert any(r.worker == "trainer0" for r in tl.of("rollout"))
    if "engine.colocated_batch=1" in sets:  # ... at its own batch; the rollout worker at its own (auto)
        assert {r.args["batch"] for r in tl.of("rollout") if r.worker == "trainer0"} == {1}
        assert {r.args["batch"] for r in tl.of("rollout") if r.worker != "trainer0"} <= {None}


@pytest.mark.faults
def test_a_lost_member_of_a_sharded_group_restarts_the_run_from_its_checkpoint(cluster, tmp_path, capsys):
    """FSDP x2 beside TAG, the follower killed as its share of iteration 1's first train unit starts
    (its lead waits in the unit's first all-gather, which fails: the lead names the dead member): with
    ``engine.trainer_restarts`` every worker starts again from the iteration-1 checkpoint, iteration 1
    runs again, and the run finishes with every group generated and trained once (as recorded) and
    the fault-free result: the single-process trainer's."""
    ref = LocalTrainer(load_config(None, BASE)).run(tmp_path / "local")
    fault = "engine.faults=[{worker: trainer1, unit: 'train-1-0-0:start'}]"
    sets = ["engine.tag=true", "output.checkpoint_every=1", "engine.trainer_restarts=1", fault]
    cfg = load_config(None, BASE + FSDP + sets)
    result = run_engine(cfg, run_dir=tmp_path / "fsdp")
    err = capsys.readouterr().err
    assert "trainer rank trainer0 died while running train-1-0-0" in err  # the lead names its lost member
    assert "restarting every worker from" in err and "iter-000001" in err
    want = load_file(tmp_path / "local" / "final" / "pytorch_lora_weights.safetensors")
    got = load_file(tmp_path / "fsdp" / "final" / "pytorch_lora_weights.safetensors")
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    assert [r["iteration"] for r in result.metrics] == [0, 1]
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["samples"] == theirs["samples"]  # nothing lost, nothing trained twice
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
    assert_timeline_invariants(cfg, Timeline.from_chrome_trace(tmp_path / "fsdp" / "timeline.json"))
