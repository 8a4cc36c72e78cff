"""The structure the docs promise (docs/architecture.md): one driver loop, one placement derivation,
the local trainer imported by the CLI only. Fast: no Ray, no model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from digenrl.config import PoolConfig, load_config
from digenrl.errors import UserError
from digenrl.placement import Plan, apply_plan
from digenrl.resolve import resolve

PACKAGE = Path(__file__).resolve().parents[1] / "digenrl"


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def test_only_the_cli_imports_the_local_trainer():
    importers = set()
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "digenrl.trainer":
                importers.add(name)
            elif isinstance(node, ast.Import) and any(a.name == "digenrl.trainer" for a in node.names):
                importers.add(name)
    assert importers and all(name.startswith("cli/") for name in importers), importers


def test_the_scheduler_is_asked_in_one_loop():
    """Only the driver loop hands out units (the runtime and the simulator run it)."""
    callers = {
        name
        for name, tree in modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("next_unit", "requeue", "release")
        and isinstance(node.ctx, ast.Load)
        and name != "engine/scheduler.py"
    }
    assert callers == {"engine/driver.py"}


DISAGG = [
    "placement.mode=disaggregated",
    "engine.tsp_degree=2",
    "engine.tag=false",
    "engine.max_staleness=1",
    "cluster.pools=[{name: r, device: H20, count: 3}, {name: t, device: H800, count: 2}]",
    "placement.rollout_pool=r",
    "placement.trainer_pool=t",
]


def test_a_run_config_and_its_plan_map_both_ways():
    cfg = load_config(None, DISAGG + ["train.device=cuda"])
    plan = Plan.from_run_config(cfg)
    assert [p.name for p in plan.pools] == ["r", "t"] and plan.ranks == 2
    assert [(w.name, w.role, w.pool.name) for w in plan.workers()] == [
        ("r0", "rollout", "r"),
        ("r1", "rollout", "r"),
        ("r2", "rollout", "r"),
        ("t0", "trainer", "t"),
        ("t1", "trainer", "t"),
    ]
    assert resolve(cfg).workers == plan.workers()  # the runtime's workers are the plan's
    back = apply_plan(cfg, plan, "cuda")
    for section in ("cluster", "placement", "engine", "train"):
        assert getattr(back, section) == getattr(cfg, section), section
    sched = plan.scheduler_config(cfg.train.prompts_per_iteration, 3)
    assert (sched.placement, sched.tsp_degree, sched.tag, sched.max_staleness) == (
        "disaggregated",
        2,
        False,
        1,
    )


def test_colocated_plan_uses_every_pool_in_both_roles():
    cfg = load_config(None, ["placement.mode=colocated"])
    plan = Plan.from_run_config(cfg)
    assert {w.role for w in plan.workers()} == {"both"} and plan.ranks == len(cfg.cluster.pools)
    assert apply_plan(cfg, plan, "cpu").cluster == cfg.cluster


def test_gpu_names_no_device_type_once_for_the_planner():
    from digenrl.planner.gpus import cluster_from_run_config

    cfg = load_config(
        None,
        [
            "placement.mode=disaggregated",
            "cluster.pools=[{name: rollout, device: gpu}, {name: trainer, device: H100}]",
        ],
    )
    with pytest.raises(UserError, match="'gpu', which names no GPU type") as a:
        Plan.from_run_config(cfg).typed()
    with pytest.raises(UserError) as b:
        cluster_from_run_config(cfg)
    assert str(a.value) == str(b.value)
    assert Plan.from_run_config(cfg).workers()[0].pool.device == "gpu"  # the runtime takes any GPU


def test_a_pool_is_one_type_in_configs_cluster_files_and_plans():
    from digenrl.planner.gpus import cluster_from_dict

    cluster = cluster_from_dict({"pools": [{"name": "a", "device": "h800", "count": 2}]})
    assert cluster.pools == [PoolConfig(name="a", device="H800", count=2)]  # canonical spelling
    with pytest.raises(UserError, match=r"cluster: pools.0.device: unknown device type 'B200'"):
        cluster_from_dict({"pools": [{"name": "a", "device": "B200", "count": 1}]})
    with pytest.raises(ValueError, match="two pools of different names"):
        Plan(placement="disaggregated", pools=(cluster.pools[0], cluster.pools[0]))
