"""The driver loop, written once: every idle worker asks the scheduler for a unit, the backend starts
it and reports, one at a time, what became of it (:class:`Done`, :class:`Released`,
:class:`Scored`, :class:`Lost`, :class:`Back`). Backends: the Ray runtime, the planner's simulator,
the scheduler tests' own (docs/architecture.md, "The scheduler and the driver loop")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from digenrl.schedule.scheduler import Scheduler
from digenrl.units.types import RolloutUnit, StepUnit, Unit


@dataclass(frozen=True)
class Done:
    worker: str
    unit: Unit


@dataclass(frozen=True)
class Released:
    worker: str
    unit: RolloutUnit


@dataclass(frozen=True)
class Scored:
    unit: RolloutUnit


@dataclass(frozen=True)
class Lost:
    unit: RolloutUnit
    worker: str | None = None  # the worker that died with it (None: only the scores were lost)


@dataclass(frozen=True)
class Back:
    worker: str


Event = Done | Released | Scored | Lost | Back


class Backend(Protocol):
    def start(self, worker: str, unit: Unit) -> None:
        """Run ``unit`` on ``worker`` (asynchronously: report it from :meth:`next_event`)."""

    def next_event(self) -> Event | None:
        """The next thing that happened to a started unit (one at a time, earliest first)."""

    def completed(self, unit: Unit, stepped: int | None) -> None:
        """The scheduler has marked ``unit`` complete; ``stepped``: the iteration whose optimizer step
        this completion finished (its new version is published), else None."""


def drive(scheduler: Scheduler, order: list[str], backend: Backend, busy=()) -> None:
    """Run ``scheduler`` to its last optimizer step on ``backend``; ``order``: the workers, in the
    order idle workers ask for work; ``busy``: those running a unit already (a BTS branch's start)."""
    idle = set(order) - set(busy)
    while not scheduler.done():
        for worker in order:
            if worker in idle and (unit := scheduler.next_unit(worker)) is not None:
                idle.discard(worker)
                backend.start(worker, unit)
        event = backend.next_event()
        if isinstance(event, (Done, Released, Back)):
            idle.add(event.worker)
        _apply(scheduler, backend, event, requeue=True)


def _apply(scheduler: Scheduler, backend: Backend, event: Event | None, requeue: bool) -> None:
    """Tell the scheduler what ``event`` means: a unit released for scoring, lost (generated again
    when ``requeue``), or complete (the backend hears whether that published a version)."""
    if isinstance(event, Released):
        scheduler.release(event.unit)
    elif isinstance(event, Lost) and requeue:
        scheduler.requeue(event.unit)
    elif isinstance(event, (Done, Scored)):
        before = scheduler.published_version
        scheduler.complete(event.unit)
        backend.completed(event.unit, before if scheduler.published_version > before else None)


def finish_running(scheduler: Scheduler, backend: Backend, owed_step_shares, running) -> None:
    """After a stop (Ctrl-C, a fatal error): start nothing new except what a collective step already
    begun still needs (``owed_step_shares()``: the idle ranks not yet handed their share), and hear
    every running unit out (``running()``: anything still in flight). A unit lost now is not
    generated again."""
    while True:
        for worker in owed_step_shares():
            unit = scheduler.next_unit(worker)
            if not isinstance(unit, StepUnit):
                raise RuntimeError(f"{worker}: expected its share of the open step, got {unit}")
            backend.start(worker, unit)
        if not running():
            return
        _apply(scheduler, backend, backend.next_event(), requeue=False)
