"""The run's layout, resolved once (docs/architecture.md, "The run's layout"): ``resolve(cfg)`` is the
one place that decides every ``auto``, the groups and the verdict; a run directory holds it; ``config
validate`` prints it; every worker runs exactly what it says and never re-derives it."""

from __future__ import annotations

import json
import os
import sys

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from digenrl.cli.app import main  # noqa: E402
from digenrl.config.run import load_config  # noqa: E402
from digenrl.placement.layout import RunLayout  # noqa: E402
from digenrl.placement.resolve import resolve  # noqa: E402
from tests.helpers import FULL_MODE, QUIET, TINY, as_sets  # noqa: E402

BASE = [
    *FULL_MODE,  # the knobs a test below leaves unset: the engine's full mode's, not the default run's
    *TINY,
    *QUIET,
    "train.iterations=1",
    "algorithm.group_size=2",
    "sampling.steps=2",
    "engine.max_staleness=0",
]
SHARDED = [  # 1 rollout worker, 2 trainer ranks in one FSDP2 shard group
    "placement.mode=disaggregated",
    "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
    "train.fsdp=2",
    "engine.tag=false",
    "engine.tsp_degree=1",
]


def _no_resolution(monkeypatch):
    """Every function that resolves a setting, made to raise: what runs after this may only read."""

    def refuse(*args, **kwargs):
        raise AssertionError("a runtime module re-derived the layout")

    import digenrl.placement.preflight
    import digenrl.placement.resolve

    for module, name in [
        (digenrl.placement.resolve, "resolve"),
        (digenrl.placement.resolve, "fsdp_degree"),
        (digenrl.placement.resolve, "check_sp"),
        (digenrl.placement.preflight, "resolve_memory_settings"),
        (digenrl.placement.preflight, "resolve_cfg_batching"),
        (digenrl.placement.preflight, "check_memory"),
    ]:
        monkeypatch.setattr(module, name, refuse)


def test_the_layout_round_trips_through_its_json():
    for sets in (["placement.mode=local"], SHARDED, ["placement.mode=colocated", "engine.max_staleness=0"]):
        layout = resolve(load_config(None, BASE + sets))
        assert RunLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    sharded = resolve(load_config(None, BASE + SHARDED))
    assert sharded.shard_groups == (("trainer0", "trainer1"),)
    assert sharded.worker("trainer1").lead == "trainer0" and sharded.worker("trainer0").followers == (
        "trainer1",
    )
    assert [w.name for w in sharded.scheduled] == ["rollout0", "trainer0"]
    assert sharded.settings.weight_sync == "broadcast" and sharded.settings.weight_sync_fallback
    assert resolve(
        load_config(None, BASE + SHARDED + ["engine.weight_sync=object_store"])
    ).settings.weight_sync == ("object_store")


def test_config_validate_prints_the_layout(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["digenrl", "config", "validate", *as_sets(BASE + SHARDED)])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr().out
    assert exc.value.code in (0, None)
    assert "plan: R 1xcpu / T 2xcpu" in out
    assert "trainer1: trainer on cpu (follows trainer0, trainer rank 1, fsdp 2)" in out
    assert "settings: trainer FSDP2 x2" in out and "verdict: runs" in out


def test_a_worker_runs_what_the_layout_says_without_resolving(monkeypatch):
    """An engine worker (the class the Ray actors run, here in this process) built from a layout whose
    settings differ from what the config would resolve to runs the layout's -- with every resolution
    function made to raise."""
    from dataclasses import replace

    from digenrl.engine.workers import EngineWorker

    cfg = load_config(None, BASE + ["placement.mode=disaggregated", "engine.tag=false"])
    layout = resolve(cfg)
    assert not layout.settings.activation_checkpointing  # auto on CPU pools
    layout = replace(  # what a GPU pool might have resolved to
        layout,
        settings=replace(
            layout.settings, activation_checkpointing=True, cfg_batching_trainer="batched", vae_tiling="on"
        ),
    )
    _no_resolution(monkeypatch)
    for name, role in (("rollout0", "rollout"), ("trainer0", "trainer")):
        worker = EngineWorker(cfg, name, role, layout=layout)
        assert worker.init_error is None, worker.init_error
        got, want = worker.resolved(), layout.worker(name)
        assert got["activation_checkpointing"] == (role == "trainer")  # only the trainer checkpoints
        assert got["cfg_batching"] == layout.settings.cfg_batching(role != "rollout")
        assert got["vae_tiling"] == "on"
        assert (got["fsdp"], got["sp"], got["rank"]) == (want.fsdp, want.sp, want.rank)


@pytest.mark.slow
def test_ray_actors_run_the_layout_and_the_run_directory_holds_it(tmp_path, ray_cluster):
    """Real Ray actors of a sharded run: each actor's resolved settings (read off what it built and the
    groups it joined) equal its part of the layout; a run writes ``layout.json`` equal to it."""
    import ray

    from digenrl.engine.cluster import ray_workers
    from digenrl.launch import run_engine

    cfg = load_config(None, BASE + SHARDED)
    layout = resolve(cfg)
    with ray_workers(cfg, layout, None) as actors:
        for name in [w.name for w in layout.workers]:
            got, want = ray.get(actors[name].resolved.remote()), layout.worker(name)
            assert (got["rank"], got["fsdp"], got["sp"]) == (want.rank, want.fsdp, want.sp), name
            assert got["followers"] == len(want.followers), name
            assert got["activation_checkpointing"] == layout.settings.activation_checkpointing or (
                want.role == "rollout" and not got["activation_checkpointing"]
            )
            assert got["cfg_batching"] == layout.settings.cfg_batching(want.role != "rollout")
            assert got["vae_tiling"] == layout.settings.vae_tiling
    result = run_engine(cfg, tmp_path / "run")
    written = json.loads((result.run_dir / "layout.json").read_text())
    assert RunLayout.from_dict(written) == layout
    assert written["groups"]["shard_groups"] == [["trainer0", "trainer1"]]


def test_a_local_run_directory_holds_its_trivial_layout(tmp_path):
    from digenrl.engine.local import LocalTrainer

    cfg = load_config(None, BASE + ["placement.mode=local"])
    result = LocalTrainer(cfg).run(tmp_path / "run")
    written = json.loads((result.run_dir / "layout.json").read_text())
    assert written["mode"] == "local" and "plan" not in written
    assert RunLayout.from_dict(written) == resolve(cfg)


def test_no_runtime_module_resolves_the_layout():
    """The runtime (engine/, adapters/, distributed/, algorithms/, policy/, units/, schedule/, run/,
    checkpoint/, the plan and the layout) neither imports the resolution (resolve, preflight, launch,
    cli) nor calls what resolves a setting or rebuilds the plan from a config: it reads the layout it
    is handed."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "digenrl"
    runtime = [
        p
        for p in package.rglob("*.py")
        if p.relative_to(package).parts[0]
        in (
            "engine",
            "adapters",
            "distributed",
            "algorithms",
            "policy",
            "units",
            "schedule",
            "run",
            "checkpoint",
        )
        or p.relative_to(package).as_posix() in ("placement/plan.py", "placement/layout.py")
    ]
    upward = ("digenrl.placement.resolve", "digenrl.placement.preflight", "digenrl.launch", "digenrl.cli")
    resolving = {
        "resolve",
        "resolve_memory_settings",
        "resolve_cfg_batching",
        "check_memory",
        "from_run_config",
    }
    found = []
    for path in runtime:
        name = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(upward):
                found.append(f"{name} imports {node.module}")
            if isinstance(node, ast.Import):
                found += [f"{name} imports {a.name}" for a in node.names if a.name.startswith(upward)]
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if called == "resolve" and isinstance(f, ast.Attribute):
                    continue  # Path.resolve
                if called in resolving and name != "placement/plan.py":  # (the plan defines from_run_config)
                    found.append(f"{name} calls {called}")
    assert not found, found
    assert len(runtime) > 30  # the walk found the runtime


def test_resolve_builds_the_memory_model_once(monkeypatch):
    """One layout, one memory model: every resolution step (memory preflight, FSDP / checkpointing,
    rollout batch, CFG batching per role) reads the one ``resolve`` built; none on logical CPU pools."""
    import digenrl.placement.resolve

    built = []
    real = digenrl.placement.resolve.memory_model
    monkeypatch.setattr(digenrl.placement.resolve, "memory_model", lambda cfg: built.append(1) or real(cfg))
    gpus = [
        "placement.mode=disaggregated",
        "engine.tag=false",
        "sampling.cfg_batching=auto",
        "cluster.pools=[{name: rollout, device: H100, count: 1}, {name: trainer, device: H100, count: 2}]",
    ]
    layout = resolve(load_config(None, BASE + gpus))
    assert len(built) == 1 and layout.settings.memory_device == "H100"
    assert layout.settings.rollout_batch is not None  # auto on a known GPU: the memory model's batch
    built.clear()
    resolve(load_config(None, BASE + SHARDED))
    assert built == []
