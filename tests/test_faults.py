"""Faults: a rollout worker killed mid-unit is restarted by Ray and its unit generated
again whole, so the run ends with every group trained exactly once and -- on-policy -- the same
weights as a run without the fault; a dead trainer rank stops the run with the last checkpoint
intact and a resume hint; restarts are bounded. Faults are injected with ``engine.faults``."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.checkpoint.store import list_checkpoints  # noqa: E402
from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.faults import FaultInjector, fault_plan, forget_fired  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.errors import RunStopped, UserError  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from digenrl.run.rundir import read_metrics  # noqa: E402
from tests.helpers import QUIET, TINY, cli  # noqa: E402

BASE = [
    *TINY,
    "train.iterations=3",
    *QUIET,
    "placement.mode=disaggregated",
    "engine.gap=true",
    "engine.tag=true",
    "engine.tsp_degree=2",
    "engine.max_staleness=0",
]


def faults(*pairs: str) -> str:
    return (
        "engine.faults=["
        + ", ".join(f"{{worker: {w}, unit: {u}}}" for w, u in (p.split("@") for p in pairs))
        + "]"
    )


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


def trained_groups(run_dir) -> Counter:
    events = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    return Counter(
        (a["iteration"], g, a["tsp_rank"])
        for e in events
        if e.get("ph") == "X"
        for a in [e["args"]]
        if a["kind"] == "train"
        for g in a["groups"]
    )


def marks_left() -> list[str]:
    """The fired-fault marks in this node's temp directory whose process is (was) an actor of the
    suite's cluster: ``digenrl-fault-<actor id>-<worker>-<fault>``."""
    from ray._private import state

    ids, marks = set(state.actors()), Path(tempfile.gettempdir()).glob("digenrl-fault-*")
    return [m.name for m in marks if m.name.split("-")[2] in ids]


@pytest.mark.faults
@pytest.mark.slow
def test_killed_rollout_worker_is_restarted_and_its_unit_regenerated(cluster, tmp_path):
    # tag off: only rollout0 rolls out, so it certainly runs (and dies in) both units named
    cfg = load_config(
        None, BASE + ["engine.tag=false", faults("rollout0@rollout-0-1", "rollout0@rollout-2-0")]
    )
    result = run_engine(cfg, tmp_path / "run")
    assert [r["iteration"] for r in result.metrics] == [0, 1, 2]
    assert result.metrics[-1]["worker_restarts"] == 2
    assert marks_left() == []  # the marks that kept the restarted process from dying again are gone
    # every group of every iteration trained exactly once per TSP rank: nothing lost, nothing twice
    assert trained_groups(tmp_path / "run") == Counter(
        {(k, g, r): 1 for k in range(3) for g in range(2) for r in range(2)}
    )
    # the re-generated units used their original version and seeds: the same update as without faults
    local = LocalTrainer(load_config(None, BASE)).run(tmp_path / "local")
    a = load_file(tmp_path / "run" / "final" / "pytorch_lora_weights.safetensors")
    b = load_file(local.run_dir / "final" / "pytorch_lora_weights.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4  # TSP sums the gradient in another order
    assert [r["reward_mean"] for r in result.metrics] == pytest.approx(
        [r["reward_mean"] for r in local.metrics], rel=1e-5
    )


@pytest.mark.faults
@pytest.mark.slow
def test_restarts_are_bounded(cluster, tmp_path):
    cfg = load_config(
        None,
        BASE
        + [
            "engine.tag=false",
            "engine.max_restarts=1",
            faults("rollout0@rollout-0-0", "rollout0@rollout-0-1"),
        ],
    )
    with pytest.raises(RunStopped, match=r"rollout worker rollout0 died 2 times \(engine.max_restarts: 1\)"):
        run_engine(cfg, tmp_path / "run")


@pytest.mark.faults
@pytest.mark.slow
def test_dead_trainer_stops_cleanly_with_a_resume_hint(cluster, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    code, _, err = cli(
        monkeypatch,
        capsys,
        "train",
        "--run-dir",
        str(run),
        *sum(
            (["--set", s] for s in BASE + ["output.checkpoint_every=1", faults("trainer0@train-2-0-1")]), []
        ),
    )
    assert code == 1
    last = err.strip().splitlines()[-1]  # (above it: Ray's own log lines about the dead process)
    assert "Traceback" not in err and last.startswith(
        "error: trainer rank trainer0 died while running train-2-0-1"
    )
    assert last.endswith(f"resume with: digenrl train --resume {run}")
    assert [p.name for p in list_checkpoints(run)] == ["iter-000001", "iter-000002"]
    # the hint works: the resumed run (without the fault) finishes
    code, out, err = cli(monkeypatch, capsys, "train", "--resume", str(run), "--set", "engine.faults=[]")
    assert code == 0, err
    assert [r["iteration"] for r in read_metrics(run)] == [0, 1, 2]


def test_a_fired_fault_is_marked_until_its_run_ends():
    """Out of Ray the process id is the incarnation: a fault fires once (its mark keeps a restarted
    process from firing it again), and once the run's marks are forgotten, a next run fires it anew."""
    me = str(os.getpid())
    injector = FaultInjector("rollout0", frozenset({"rollout-0-0:drop"}))
    with pytest.raises(ConnectionError, match="rollout0's connection dropped in rollout-0-0"):
        injector.reached("rollout-0-0")
    injector.reached("rollout-0-0")  # marked: not again
    forget_fired(["1", me])  # (another process's marks: none)
    assert not list(Path(tempfile.gettempdir()).glob(f"digenrl-fault-{me}-*"))
    with pytest.raises(ConnectionError):
        injector.reached("rollout-0-0")
    forget_fired([me])


def test_fault_plan_from_the_environment(monkeypatch):
    monkeypatch.setenv("DIGENRL_FAULTS", "rollout0@rollout-1-0, rollout1@rollout-2-3")
    assert fault_plan(load_config(None, BASE)) == {("rollout0", "rollout-1-0"), ("rollout1", "rollout-2-3")}
    monkeypatch.setenv("DIGENRL_FAULTS", "rollout0")
    with pytest.raises(UserError, match="DIGENRL_FAULTS: expected worker@unit"):
        fault_plan(load_config(None, BASE))


@pytest.mark.faults
@pytest.mark.slow
def test_killed_reward_actor_is_restarted_and_the_call_run_again(cluster, tmp_path):
    """reward.service: the actor dies scoring rollout-1-0 (the worker has already moved on); Ray
    restarts it and runs the lost call again (scoring is pure), so no unit loses its scores or is
    generated twice, and every group is trained exactly once."""
    cfg = load_config(
        None, BASE + ["engine.tag=false", "reward.service={num_cpus: 0.1}", faults("reward@rollout-1-0")]
    )
    result = run_engine(cfg, tmp_path / "run")
    assert [r["iteration"] for r in result.metrics] == [0, 1, 2]
    assert result.metrics[-1]["worker_restarts"] == 1  # Ray restarted the reward actor once
    assert trained_groups(tmp_path / "run") == Counter(
        {(k, g, r): 1 for k in range(3) for g in range(2) for r in range(2)}
    )
    events = json.loads((tmp_path / "run" / "timeline.json").read_text())["traceEvents"]
    rolled = Counter(
        e["args"]["unit"] for e in events if e.get("ph") == "X" and e["args"]["kind"] == "rollout"
    )
    assert set(rolled.values()) == {1}
