"""Checkpoints, resume and periodic eval in the Ray engine (docs/architecture.md: the run directory, on the
engine).

On-policy (max_staleness 0, one trainer rank) the engine equals the single-process trainer, so a
run stopped at a checkpoint and resumed must reproduce the uninterrupted run exactly. In async
mode the pipeline restarts empty: the resumed run generates every group of the remaining
iterations again with the checkpoint's weights and trains each exactly once."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.checkpoint.load import load_checkpoint  # noqa: E402
from digenrl.checkpoint.store import list_checkpoints  # noqa: E402
from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from digenrl.policy.model import Policy  # noqa: E402
from digenrl.run.rundir import read_metrics  # noqa: E402
from tests.helpers import TINY, cli  # noqa: E402

pytestmark = pytest.mark.slow  # Ray, subprocess or learning runs: ./dev.sh test -m "not slow" skips them

BASE = [
    *TINY,
    "train.iterations=4",
    "output.checkpoint_every=2",
    "output.eval_every=2",
    "output.save_samples_every=0",
    "placement.mode=disaggregated",
    "engine.gap=true",
    "engine.tag=true",
    "engine.tsp_degree=2",
]
ON_POLICY = BASE + ["engine.max_staleness=0"]
ASYNC = BASE + ["engine.max_staleness=1"]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


@pytest.fixture(scope="module")
def on_policy_runs(cluster, tmp_path_factory):
    """Uninterrupted engine run; the same resumed from its iteration-2 checkpoint; the local trainer."""
    tmp = tmp_path_factory.mktemp("engine-resume")
    cfg = load_config(None, ON_POLICY)
    full = run_engine(cfg, tmp / "full")
    resumed = run_engine(cfg, tmp / "resumed", resume=tmp / "full" / "checkpoints" / "iter-000002")
    local = LocalTrainer(cfg).run(tmp / "local")
    return full, resumed, local


def test_engine_writes_checkpoints_and_eval(on_policy_runs):
    full, _, local = on_policy_runs
    assert [p.name for p in list_checkpoints(full.run_dir)] == ["iter-000002", "iter-000004"]
    # the last checkpoint holds the final weights, loadable into a fresh policy (verified load)
    policy = Policy(load_config(None, ON_POLICY))
    state = load_checkpoint(full.run_dir / "checkpoints" / "iter-000004", policy)
    assert state.iteration == state.version == 4 and state.extra["driver"] == "engine"
    final = load_file(full.run_dir / "final" / "pytorch_lora_weights.safetensors")
    ckpt = load_file(full.run_dir / "checkpoints" / "iter-000004" / "pytorch_lora_weights.safetensors")
    assert final.keys() == ckpt.keys() and all((final[k] == ckpt[k]).all() for k in final)
    # eval every 2 iterations, logged like any metric, equal to the single-process trainer's
    rows = read_metrics(full.run_dir)
    evals = {r["iteration"]: r["eval/prompt_color"] for r in rows if "eval/prompt_color" in r}
    local_evals = {r["iteration"]: r["eval/prompt_color"] for r in local.metrics if "eval/prompt_color" in r}
    assert sorted(evals) == [1, 3]
    assert evals == pytest.approx(local_evals, abs=1e-6)


def test_engine_resume_reproduces_the_uninterrupted_run(on_policy_runs):
    full, resumed, _ = on_policy_runs
    a, b = read_metrics(full.run_dir), read_metrics(resumed.run_dir)
    assert [r["iteration"] for r in b] == [0, 1, 2, 3]  # history of the source run + the resumed rows
    # With TAG the order in which units reach the trainer (so the float summation order of the
    # gradient) depends on timing; the loss, a mean of advantage x ratio with advantages summing to
    # zero, is itself at round-off level (~1e-6), so it is compared absolutely.
    assert [r["reward_mean"] for r in b] == pytest.approx([r["reward_mean"] for r in a], rel=1e-5)
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], abs=1e-5)
    wa = load_file(full.run_dir / "final" / "pytorch_lora_weights.safetensors")
    wb = load_file(resumed.run_dir / "final" / "pytorch_lora_weights.safetensors")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


def test_async_resume_restarts_the_pipeline_with_nothing_trained_twice(
    cluster, tmp_path, monkeypatch, capsys
):
    cfg = load_config(None, ASYNC)
    full = run_engine(cfg, tmp_path / "full")
    # the uninterrupted async run did roll out iteration 2 with version 1 (that is what async means) ...
    before = json.loads((full.run_dir / "timeline.json").read_text())["traceEvents"]
    assert any(
        e["args"]["kind"] == "rollout" and e["args"]["iteration"] == 2 and e["args"]["version"] == 1
        for e in before
        if e.get("ph") == "X"
    )
    # ... a run resumed from the iteration-2 checkpoint (through the CLI, into a fork) generates
    # iterations 2 and 3 again with versions >= 2 and trains every group of them exactly once
    code, out, err = cli(
        monkeypatch,
        capsys,
        "train",
        "--resume",
        str(full.run_dir / "checkpoints" / "iter-000002"),
        "--run-dir",
        str(tmp_path / "fork"),
    )
    assert code == 0, err
    assert "resuming from" in out and "iteration 2 of 4" in out
    events = [
        e
        for e in json.loads((tmp_path / "fork" / "timeline.json").read_text())["traceEvents"]
        if e.get("ph") == "X"
    ]
    rollouts = [e["args"] for e in events if e["args"]["kind"] == "rollout"]
    assert {a["iteration"] for a in rollouts} == {2, 3} and min(a["version"] for a in rollouts) >= 2
    trained = Counter(
        (a["iteration"], g, a["tsp_rank"])
        for e in events
        if (a := e["args"])["kind"] == "train"
        for g in a["groups"]
    )
    assert trained == Counter({(k, g, r): 1 for k in (2, 3) for g in range(2) for r in range(2)})
    assert [r["iteration"] for r in read_metrics(tmp_path / "fork")] == [0, 1, 2, 3]
    assert [p.name for p in list_checkpoints(tmp_path / "fork")] == ["iter-000004"]  # a fork starts its own
