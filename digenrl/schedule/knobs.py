"""The engine's knobs, declared once: the fields a run config's ``engine`` section, a placement
:class:`~digenrl.placement.plan.Plan` and the :class:`~digenrl.schedule.scheduler.SchedulerConfig` share.

Details: docs/modules.md, `digenrl.schedule.knobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class SchedulingKnobs:
    """What the scheduler's decisions depend on (docs/architecture.md, "Knobs")."""

    unit_groups: int = 1  # GAP unit size m: prompt groups per rollout unit (1 with sub-group units)
    group_parts: int = 1  # sub-group units: rollout units per group (P > 1: 1/P of one group each)
    tsp_degree: int = 1  # time-step parallelism degree D
    tag: bool | str = False  # trainer-assisted generation: False off, True on, "auto" elastic (BTS)
    gap: bool = True  # release train units per rollout unit (else per iteration)
    max_staleness: int = 0  # 0 (on-policy) or 1 (one-step async)


@dataclass(frozen=True, kw_only=True)
class EngineKnobs(SchedulingKnobs):
    """... plus what the placement adds: the devices a worker spans."""

    rollout_sp: int = 1  # sequence parallelism: devices per rollout worker (colocated: per device-group)
    trainer_sp: int = 1  # ... per trainer rank (colocated: equal to rollout_sp)


def knob_values(obj, kind: type = EngineKnobs) -> dict:
    """``obj``'s values of ``kind``'s knobs, by name."""
    return {f.name: getattr(obj, f.name) for f in fields(kind)}


def group_parts(group_size: int, unit_samples: int | None) -> int:
    """Rollout units per prompt group: ``group_size / unit_samples`` (1: whole groups)."""
    return group_size // unit_samples if unit_samples else 1


def unit_samples(group_size: int, parts: int) -> int | None:
    """Samples per sub-group unit (``engine.unit_samples``), or None for whole groups."""
    return group_size // parts if parts > 1 else None


def from_engine_config(engine, group_size: int) -> dict:
    """The knobs of a run config's ``engine`` section (an ``EngineConfig``), by name."""
    out = {f.name: getattr(engine, f.name) for f in fields(EngineKnobs) if f.name != "group_parts"}
    out["tag"] = False if out["tag"] is None else out["tag"]  # unset: off until resolve() settles it
    return {**out, "group_parts": group_parts(group_size, engine.unit_samples)}


def engine_config_values(knobs: EngineKnobs, group_size: int) -> dict:
    """The ``engine`` section's values for ``knobs`` (the inverse of :func:`from_engine_config`)."""
    out = {k: v for k, v in knob_values(knobs).items() if k != "group_parts"}
    return {**out, "unit_samples": unit_samples(group_size, knobs.group_parts)}
