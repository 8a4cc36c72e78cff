"""The engine's knobs, declared once (digenrl/schedule/knobs.py): the plan and the scheduler inherit
them, the run config carries the same names, and the conversions go by name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from digenrl.config.engine import EngineConfig
from digenrl.config.run import load_config
from digenrl.placement.plan import Plan, apply_plan
from digenrl.schedule.knobs import EngineKnobs, SchedulingKnobs, engine_config_values, from_engine_config
from digenrl.schedule.scheduler import SchedulerConfig
from tests.helpers import FULL_MODE

PACKAGE = Path(__file__).resolve().parents[1] / "digenrl"


def test_plan_and_scheduler_inherit_the_knobs_and_the_config_names_them():
    knobs = {f.name for f in dataclasses.fields(EngineKnobs)}
    assert {f.name for f in dataclasses.fields(SchedulingKnobs)} <= knobs
    assert issubclass(Plan, EngineKnobs) and issubclass(SchedulerConfig, SchedulingKnobs)
    # the config spells sub-group units as samples per unit; every other knob by its own name
    assert knobs - {"group_parts"} | {"unit_samples"} <= set(EngineConfig.model_fields)
    with pytest.raises(TypeError):  # keyword construction only
        Plan("colocated", (), 1)


@pytest.mark.parametrize(
    "sets",
    [
        ["engine.unit_samples=2", "algorithm.group_size=4"],
        ["engine.unit_groups=2", "train.prompts_per_iteration=4", "engine.tag=false", "engine.gap=false"],
        ["engine.rollout_sp=2", "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]"],
    ],
)
def test_config_and_plan_convert_by_name_both_ways(sets):
    cfg = load_config(None, [*FULL_MODE, *sets])
    G = cfg.algorithm.group_size
    plan = Plan.from_run_config(cfg)
    assert {k: getattr(plan, k) for k in from_engine_config(cfg.engine, G)} == from_engine_config(
        cfg.engine, G
    )
    assert plan.group_parts == (G // cfg.engine.unit_samples if cfg.engine.unit_samples else 1)
    values = engine_config_values(plan, G)
    assert values == {k: getattr(cfg.engine, k) for k in values}  # the config's own values come back
    back = apply_plan(cfg, plan, "cpu")
    assert Plan.from_run_config(back) == plan


def test_the_scheduler_stays_pure_python():
    """scheduler.py and what it imports from the package import no pydantic, torch or Ray."""
    for name in ("schedule/scheduler.py", "schedule/knobs.py", "units/types.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        heavy = {m for m in imported if m.split(".")[0] in ("pydantic", "torch", "ray")}
        package = {m for m in imported if m.startswith("digenrl")}
        assert not heavy, (name, heavy)
        assert package <= {"digenrl.schedule.knobs", "digenrl.units.types"}, (name, package)
