"""Elastic TAG (``engine.tag: auto``): BTS, the bubble-triggered TAG search of the authors' RFC
(verl-project/verl-omni#321, "BTS: insert TAG only when it reduces predicted makespan"). Where an
idle trainer rank could take a rollout unit, both continuations -- InsertTAG (take it) and
SkipBubble (wait) -- are played forward by the scheduler's own policy on a fork of its state, with
predicted unit times (:class:`UnitTimes`: the profile's, replaced by the run's measured means), up
to the publish of the version the decision can delay; the shorter predicted makespan wins.

Pure Python: the clock is the backend's (wall time in the Ray runtime, virtual time in the planner's
simulator). docs/architecture.md, "Elastic TAG (BTS)"."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from digenrl.schedule.driver import Done, Event, Released, Scored, drive
from digenrl.units.types import RolloutUnit, StepUnit, TrainUnit, Unit

if TYPE_CHECKING:
    from digenrl.schedule.scheduler import Scheduler

BTS_KEYS = ("kind", "uid", "iteration", "end", "args")  # a runtime event's fields, event_args' order
KINDS = ("rollout", "train", "step", "score")  # score: a released rollout unit's wait for its rewards
RECENT = 8  # measured unit times: the mean of the last RECENT (the host's speed drifts)
KEPT = 4096  # decisions kept in Elastic.decisions (the timeline logs each; a long run makes many)


def tag_mode(tag) -> str:
    """``engine.tag`` as a word: off (False), on (True) or auto."""
    return "auto" if tag == "auto" else "on" if tag else "off"


class UnitTimes:
    """Seconds a unit of ``kind`` takes on ``worker``: the mean of the run's last measurements there,
    else the mean measured on the workers of its ``peers`` group (the same pool), else the prior (the
    cost model's), else None (unknown)."""

    def __init__(self, priors: dict | None = None, peers: dict[str, str] | None = None):
        self.priors = dict(priors or {})
        self.peers = dict(peers or {})
        self.measured: dict[tuple[str, str], deque[float]] = defaultdict(lambda: deque(maxlen=RECENT))

    def measure(self, kind: str, worker: str, seconds: float) -> None:
        self.measured[(kind, worker)].append(max(0.0, seconds))

    def get(self, kind: str, worker: str) -> float | None:
        seen = self.measured.get((kind, worker))
        if seen:
            return sum(seen) / len(seen)
        group = self.peers.get(worker)
        same = [xs for (k, w), xs in self.measured.items() if k == kind and self.peers.get(w) == group]
        alike = [x for xs in same for x in xs]
        if alike:
            return sum(alike) / len(alike)
        if (kind, worker) in self.priors:
            return self.priors[(kind, worker)]
        return 0.0 if kind == "score" else None  # score: nothing released yet, scored inside the unit


@dataclass
class Decision:
    """One BTS decision: at ``at``, rank ``worker`` inserts (``insert``) or skips; the predicted
    publish time of version ``target`` either way; ``actual``: when it published (then the error)."""

    worker: str
    at: float
    target: int
    insert_at: float
    skip_at: float
    insert: bool
    reason: str = "predicted"  # or "unmeasured": a unit time is unknown yet, TAG taken as with tag: on
    uid: str | None = None  # the rollout unit taken
    actual: float | None = None

    def predicted(self) -> float:
        return self.insert_at if self.insert else self.skip_at

    def error(self) -> float | None:
        """(actual - predicted) / predicted, both counted from the decision."""
        if self.actual is None or not math.isfinite(self.predicted()) or self.predicted() <= self.at:
            return None
        return (self.actual - self.predicted()) / (self.predicted() - self.at)


class Elastic:
    """The scheduler's advisor for ``tag: auto``: it hears every hand-out, release and completion
    (unit times measured on ``clock``) and answers :meth:`insert` at a TAG point. ``depth``: decision
    points searched recursively (1: the asking one; later ones follow the branch's choice);
    ``max_events``: a branch's length bound."""

    def __init__(self, times: UnitTimes, clock: Callable[[], float], depth: int = 1, max_events: int = 4000):
        self.times, self.clock, self.depth, self.max_events = times, clock, depth, max_events
        self.running: dict[str, tuple[str, Unit, float]] = {}  # uid -> (worker, unit, started)
        self.released: dict[str, tuple[RolloutUnit, str, float]] = {}  # uid -> (unit, worker, released)
        self.step_starts: dict[tuple[int, int], list[float]] = defaultdict(list)
        self.decisions: deque[Decision] = deque(maxlen=KEPT)  # the latest, for reports
        self.by_uid: dict[str, Decision] = {}  # TAG rollout uid -> its decision
        self.by_target: dict[int, list[Decision]] = defaultdict(list)  # version -> decisions ending there
        self.changes = 0  # scheduler state changes heard: a decision's memo key
        self._memo: dict = {}

    # -- what the scheduler tells it --------------------------------------------------------

    def started(self, worker: str, unit: Unit) -> None:
        now = self.clock()
        self.changes += 1
        self.running[unit.uid] = (worker, unit, now)
        if isinstance(unit, StepUnit):
            self.step_starts[(unit.iteration, unit.step)].append(now)

    def released_unit(self, unit: RolloutUnit) -> None:
        self.changes += 1
        worker, _, began = self.running.pop(unit.uid)
        now = self.clock()
        self.times.measure("rollout", worker, now - began)
        self.released[unit.uid] = (unit, worker, now)

    def completed(self, unit: Unit) -> None:
        self.changes += 1
        now = self.clock()
        if unit.uid in self.released:
            _, worker, at = self.released.pop(unit.uid)
            self.times.measure("score", worker, now - at)
            return
        worker, _, began = self.running.pop(unit.uid)
        if isinstance(unit, StepUnit):  # the collective: from its last rank's arrival
            began = max(self.step_starts[(unit.iteration, unit.step)])
        kind = {RolloutUnit: "rollout", TrainUnit: "train", StepUnit: "step"}[type(unit)]
        self.times.measure(kind, worker, now - began)
        if isinstance(unit, RolloutUnit):
            self.times.measure("score", worker, 0.0)

    def forget(self, unit: Unit) -> None:
        """A unit lost (re-queued): nothing measured."""
        self.changes += 1
        self.running.pop(unit.uid, None)
        self.released.pop(unit.uid, None)

    # -- the decision ------------------------------------------------------------------------

    def insert(self, sched: Scheduler, worker: str) -> bool:
        """InsertTAG (True) or SkipBubble: the shorter predicted makespan (a stall counts as
        infinite; a tie skips). Memoized per state and pool: symmetric idle ranks asking in one
        round cost one search."""
        key = (self.changes, self.times.peers.get(worker, worker))
        if key not in self._memo:
            now = self.clock()
            target = horizon(sched)
            root = Branch(self, sched.fork(), now, self._jobs(now), 0)
            self._memo = {key: (now, target, *root.compare(worker))}
        now, target, at_insert, at_skip = self._memo[key]
        if target not in self.by_target:  # a new horizon: forget the decisions logged already
            self._forget_before(sched.published_version)
        if at_insert is None:  # a unit time unknown yet: TAG as with tag: on (it gets measured)
            d = Decision(worker, now, target, math.nan, math.nan, True, "unmeasured")
        else:
            d = Decision(worker, now, target, at_insert, at_skip, shorter(at_insert, at_skip))
        self.decisions.append(d)
        self.by_target[target].append(d)
        return d.insert

    def taken(self, worker: str, unit: RolloutUnit) -> None:
        """The rollout unit the last decision inserted."""
        self.decisions[-1].uid = unit.uid
        self.by_uid[unit.uid] = self.decisions[-1]

    def _forget_before(self, version: int) -> None:
        """Drop the decisions whose makespan ended before ``version`` (their publish was logged)."""
        for v in [v for v in self.by_target if v < version]:
            del self.by_target[v]
        for uid in [u for u, d in self.by_uid.items() if d.target < version]:
            del self.by_uid[uid]

    def _jobs(self, now: float) -> list[tuple]:
        out = []
        for uid, (worker, unit, began) in self.running.items():
            out.append((began, worker, unit, "run"))
        for uid, (unit, worker, at) in self.released.items():
            out.append((at, worker, unit, "score"))
        return out

    # -- the log ---------------------------------------------------------------------------------

    def event_args(self, kind: str, uid: str, iteration: int, end: float, args: dict) -> dict:
        """Timeline args to add to an event (``args``: its own): a TAG rollout unit's two predictions
        (seconds from its decision); a step that publishes iteration k's version (its ``end``: the
        publish) the decisions whose makespan it ends, their error (their ``actual`` set)."""
        if kind == "rollout":
            d = self.by_uid.get(uid)
            if d is None or d.reason != "predicted":
                return {} if d is None else {"bts": {"why": d.reason}}
            ahead = {"insert_s": d.insert_at - d.at, "skip_s": d.skip_at - d.at}
            ahead = {k: v if math.isfinite(v) else None for k, v in ahead.items()}  # a stall: null
            return {"bts": {**ahead, "why": d.reason}}
        if kind != "step" or "publishes" not in args:
            return {}
        mine = [d for d in self.by_target.get(iteration + 1, ()) if d.reason == "predicted"]
        for d in mine:
            d.actual = end if d.actual is None else d.actual
        errors = [e for d in mine if (e := d.error()) is not None]
        if not mine:
            return {}
        return {
            "bts": {
                "decisions": len(mine),
                "inserted": sum(d.insert for d in mine),
                "mean_abs_error": sum(map(abs, errors)) / len(errors) if errors else None,
            }
        }


def horizon(sched: Scheduler) -> int:
    """The version whose publish ends a predicted makespan: the next, or (one-step async, where a
    TAG unit may be of the next iteration) the one after."""
    return min(sched.cfg.iterations, sched.published_version + 1 + sched.cfg.max_staleness)


def shorter(at_insert: float, at_skip: float) -> bool:
    """InsertTAG only when it ends sooner (a tie skips; a stall without TAG always inserts)."""
    return math.isinf(at_skip) or at_insert < at_skip - 1e-9 * max(1.0, abs(at_skip))


class _End(Exception):
    """A branch ends: its horizon's version published (``at``), a stall (inf), or an unknown time."""

    def __init__(self, at: float):
        self.at = at


class Branch:
    """A continuation of the run on a forked scheduler, in predicted time: the driver loop itself
    (:func:`~digenrl.schedule.driver.drive`) on this backend, whose jobs end when their predicted
    times say; the fork's TAG points ask this branch (:meth:`insert`)."""

    def __init__(self, elastic: Elastic, sched: Scheduler, now: float, jobs: list[tuple], depth: int):
        self.el, self.sched, self.now, self.depth = elastic, sched, now, depth
        sched.elastic = _Asks(self)
        self.seq = itertools.count()
        self.heap: list[tuple] = []  # (end, seq, worker, unit, phase)
        self.waiting: dict[tuple[int, int], list[tuple[float, str, StepUnit]]] = defaultdict(list)
        self.busy: set[str] = set()
        self.policy: bool | None = None  # the branch's choice at later decision points
        self.forced: dict[str, bool] = {}
        self.unknown = False
        self.events = 0
        for began, worker, unit, phase in jobs:
            self._add(worker, unit, began, phase)

    def fork(self) -> Branch:
        other = Branch(self.el, self.sched.fork(), self.now, [], self.depth + 1)
        other.heap, other.busy, other.policy = list(self.heap), set(self.busy), self.policy
        other.waiting = defaultdict(list, {k: list(v) for k, v in self.waiting.items()})
        other.seq = itertools.count(next(self.seq))
        return other

    def compare(self, worker: str) -> tuple[float | None, float | None]:
        """Predicted publish times of the target version with ``worker`` inserting / skipping now
        (None, None: a unit time is unknown)."""
        out = []
        for choice in (True, False):
            branch = self.fork()
            branch.forced, branch.policy = {worker: choice}, choice
            t = branch.run()
            if branch.unknown:
                return None, None
            out.append(t)
        return out[0], out[1]

    def insert(self, worker: str) -> bool:
        """The fork's TAG point: the forced first choice, a search within the depth bound, else the
        branch's own choice."""
        if worker in self.forced:
            return self.forced.pop(worker)
        if self.depth < self.el.depth:
            at_insert, at_skip = self.compare(worker)
            if at_insert is None:
                self.unknown = True
                return True
            return shorter(at_insert, at_skip)
        return bool(self.policy)

    def run(self) -> float:
        self.target = horizon(self.sched)
        if self.sched.published_version >= self.target:
            return self.now
        try:
            drive(self.sched, list(self.sched._roles), self, busy=self.busy)
        except _End as end:
            return end.at
        return self.now  # the run's last step

    # -- the driver loop's backend ----------------------------------------------------------------

    def start(self, worker: str, unit: Unit) -> None:
        self._add(worker, unit, self.now, "run")
        if self.unknown:
            raise _End(self.now)

    def next_event(self) -> Event:
        self.events += 1
        if not self.heap or self.events > self.el.max_events:
            raise _End(math.inf if not self.heap else self.now)  # a stall: nothing runs or can start
        self.now, _, worker, unit, phase = heapq.heappop(self.heap)
        if phase == "score":
            return Scored(unit)
        self.busy.discard(worker)
        lag = self.el.times.get("score", worker) if isinstance(unit, RolloutUnit) else 0.0
        if lag:
            heapq.heappush(self.heap, (self.now + lag, next(self.seq), worker, unit, "score"))
            return Released(worker, unit)
        return Done(worker, unit)

    def completed(self, unit: Unit, stepped: int | None) -> None:
        if self.sched.published_version >= self.target:
            raise _End(self.now)

    def _add(self, worker: str, unit: Unit, began: float, phase: str) -> None:
        if phase == "score":
            lag = self.el.times.get("score", worker) or 0.0
            heapq.heappush(self.heap, (max(self.now, began + lag), next(self.seq), worker, unit, phase))
            return
        self.busy.add(worker)
        kind = {RolloutUnit: "rollout", TrainUnit: "train", StepUnit: "step"}[type(unit)]
        d = self.el.times.get(kind, worker)
        if d is None:
            self.unknown = True
            d = 0.0
        if isinstance(unit, StepUnit):  # the collective ends a step's time after its last rank arrives
            arrived = self.waiting[(unit.iteration, unit.step)]
            arrived.append((began, worker, unit))
            if len(arrived) == len(self.sched._step_unfinished):  # every rank yet to finish it
                end = max(b for b, _, _ in arrived) + d
                for _, w, u in arrived:
                    heapq.heappush(self.heap, (max(self.now, end), next(self.seq), w, u, "run"))
                del self.waiting[(unit.iteration, unit.step)]
            return
        heapq.heappush(self.heap, (max(self.now, began + d), next(self.seq), worker, unit, phase))


class _Asks:
    """A fork's advisor: its TAG points go to the branch; its hand-outs are the branch's own."""

    def __init__(self, branch: Branch):
        self.insert = lambda sched, worker: branch.insert(worker)

    def _hear(self, *_) -> None:
        pass

    taken = started = released_unit = completed = forget = _hear


def elastic_for(cfg, workers, clock: Callable[[], float], priors: dict | None = None) -> Elastic | None:
    """The advisor of a disaggregated ``tag: auto`` run (``cfg``: its SchedulerConfig), else None;
    ``priors``: the cost model's unit times (``placement/tag_choice.py``); without them every unit
    time is the run's own measurement (until then TAG is taken)."""
    if cfg.tag != "auto" or cfg.placement != "disaggregated":
        return None
    return Elastic(UnitTimes(priors, {w.name: w.role for w in workers}), clock)
