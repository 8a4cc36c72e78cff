"""A simulation's result (:class:`SimResult`: the plan, its timeline, the steady-state summary, the
bound) and the steady-state summary itself, the same for a simulated and a real run's timeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from digenrl.engine.timeline import Timeline
from digenrl.placement.plan import Plan
from digenrl.planner.memory import DeviceSetup
from digenrl.schedule.scheduler import Scheduler


@dataclass
class SimResult:
    plan: Plan
    timeline: Timeline
    scheduler: Scheduler
    summary: dict  # Timeline.summary over the measured iterations
    bound_s: float  # the throughput bound on the iteration time (docs/architecture.md)
    setups: dict[str, DeviceSetup] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.summary["samples_per_s"]

    @property
    def bubble_fraction(self) -> float:
        return self.summary["bubble_fraction"]

    @property
    def iteration_s(self) -> float:
        return self.summary.get("iteration_s", 0.0)

    @property
    def efficiency(self) -> float:
        return self.bound_s / self.iteration_s if self.iteration_s else 0.0

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.timeline.save_json(directory / "timeline.json")
        self.timeline.to_png(directory / "timeline.png")


def pool_summaries(rows: list[dict]) -> dict:
    """Steady-state summaries of replicated runs as one: samples / wall time over all of them, the
    other figures averaged."""
    if len(rows) == 1:
        return rows[0]
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    wall, samples = sum(r["wall_s"] for r in rows), sum(r["samples"] for r in rows)
    out.update(
        wall_s=wall / len(rows),
        samples=samples / len(rows),
        samples_per_s=samples / wall if wall > 0 else 0.0,
    )
    return out


def steady_summary(timeline: Timeline, skip: int | None = None, tail: int | None = None) -> dict:
    """:meth:`Timeline.summary` of the steady state, the same for a real run's timeline.json and a
    simulated one: without the first iteration (nothing to overlap with yet) and, from 3 iterations
    on, the last (with one-step async it holds no next rollout)."""
    n = len(timeline.iteration_spans())
    skip = (1 if n > 1 else 0) if skip is None else skip
    tail = (1 if n - skip > 1 and n >= 3 else 0) if tail is None else tail
    return {"iterations": 0, "iteration_s": 0.0, **timeline.summary(skip=skip, tail=tail)}
