"""The scheduling policy, driven in virtual time: invariants on every mode, plus worked examples."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from digenrl.schedule.bts import elastic_for
from digenrl.schedule.driver import Back, Done, Lost, Released, Scored, drive
from digenrl.schedule.scheduler import Scheduler, SchedulerConfig
from digenrl.units.types import RolloutUnit, StepUnit, TrainUnit, Unit, WorkerSpec

Duration = Callable[[str, Unit], float]


@dataclass(frozen=True)
class Event:
    worker: str
    unit: Unit
    start: float
    end: float  # the worker is free again
    scored: float | None = None  # a released rollout unit: its rewards arrive (complete) here

    @property
    def ready(self) -> float:
        """When the unit's output is usable (the scheduler's ``complete``)."""
        return self.end if self.scored is None else self.scored


#: reward-service latency of a rollout unit: None = scored inside the unit (no release)
Scoring = Callable[[str, RolloutUnit], float | None]


class VirtualTime:
    """The driver loop's backend for these tests: units take ``duration`` in virtual time and finish
    earliest first (submission order breaks ties).

    With ``scoring``, a rollout unit given a latency is released when its worker finishes (the
    worker asks for work at once) and scored that latency later, as the reward service does.
    ``dies(event)``: the rollout worker running ``event`` dies before finishing it (its unit is
    lost, the worker comes back idle at once), or the scores of a released unit are lost; failed
    events are not kept in ``events``."""

    def __init__(
        self,
        sched: Scheduler,
        workers: list[WorkerSpec],
        duration: Duration,
        scoring: Scoring | None = None,
        dies=None,
    ):
        self.sched, self.cfg, self.duration, self.scoring, self.dies = (
            sched,
            sched.cfg,
            duration,
            scoring,
            dies,
        )
        self.roles = {w.name: w.role for w in workers}
        self.mortal = {
            w.name for w in workers if w.role == "rollout"
        }  # a dead trainer rank stops the run instead
        self.heap: list[tuple[float, int, Event]] = []
        self.seq = itertools.count()
        self.events: list[Event] = []
        self.now = 0.0
        self.back: list[str] = []  # workers that died and are idle again at once
        self.handed = 0

    def start(self, worker: str, unit: Unit) -> None:
        sched, cfg = self.sched, self.cfg
        if isinstance(unit, RolloutUnit):
            assert unit.version == sched.worker_version(worker)
            # older: a re-queued unit, or a later part of a group pinned to its first part's version
            assert unit.version == sched.published_version or (
                self.roles[worker] == "rollout" and (self.dies is not None or unit.parts > 1)
            )
            assert unit.version >= unit.iteration - cfg.max_staleness
        elif isinstance(unit, TrainUnit):
            assert sched.published_version == unit.iteration == sched.worker_version(worker)
        self.handed += 1
        assert self.handed < 100_000, "the run did not terminate"
        event = Event(worker, unit, self.now, self.now + self.duration(worker, unit))
        heapq.heappush(self.heap, (event.end, next(self.seq), event))

    def next_event(self):
        if self.back:
            return Back(self.back.pop())
        assert self.heap, (
            f"deadlock at t={self.now}: nothing in flight, "
            f"published {self.sched.published_version} of {self.cfg.iterations} versions"
        )
        self.now, _, event = heapq.heappop(self.heap)
        if event.scored is not None:  # the reward service answers, or the scores were lost
            if self.dies is not None and self.dies(event):
                return Lost(event.unit)
            self.events.append(event)
            return Scored(event.unit)
        if (
            self.dies is not None
            and isinstance(event.unit, RolloutUnit)
            and event.worker in self.mortal
            and self.dies(event)
        ):
            self.back.append(event.worker)
            return Lost(event.unit, event.worker)
        latency = (
            self.scoring(event.worker, event.unit)
            if self.scoring and isinstance(event.unit, RolloutUnit)
            else None
        )
        if latency is not None:  # generated and handed to the reward service: the worker goes on
            event = Event(event.worker, event.unit, event.start, event.end, self.now + latency)
            heapq.heappush(self.heap, (event.scored, next(self.seq), event))
            return Released(event.worker, event.unit)
        self.events.append(event)
        return Done(event.worker, event.unit)

    def completed(self, unit: Unit, stepped: int | None) -> None:
        assert stepped is None or self.sched.published_version == stepped + 1, (
            "versions increase one at a time"
        )
        if isinstance(unit, RolloutUnit):
            assert stepped is None, "a rollout completion never steps"


def simulate(
    cfg: SchedulerConfig,
    workers: list[WorkerSpec],
    duration: Duration,
    scoring: Scoring | None = None,
    dies=None,
) -> tuple[Scheduler, list[Event]]:
    """The engine's driver loop on :class:`VirtualTime`: after each completion, every idle worker
    asks for work, in a fixed order (runs are reproducible)."""
    clock = []  # tag auto: BTS on the backend's virtual clock, unit times as measured
    sched = Scheduler(cfg, workers, elastic_for(cfg, workers, lambda: clock[0].now))
    backend = VirtualTime(sched, workers, duration, scoring, dies)
    clock.append(backend)
    drive(sched, [w.name for w in workers], backend)
    assert not backend.heap, "units still running after the last step"
    assert all(sched.next_unit(w.name) is None for w in workers), "work handed out after done()"
    return sched, backend.events


def check_invariants(
    cfg: SchedulerConfig, workers: list[WorkerSpec], sched: Scheduler, events: list[Event]
) -> None:
    roles = {w.name: w.role for w in workers}
    ranks = sorted(n for n, r in roles.items() if r != "rollout")
    m, n_groups, degree = cfg.unit_groups, cfg.groups_per_iteration, cfg.tsp_degree
    stale, n_iter, first = cfg.max_staleness, cfg.iterations, cfg.start_iteration  # first: resumed at
    rollouts = [e for e in events if isinstance(e.unit, RolloutUnit)]
    trains = [e for e in events if isinstance(e.unit, TrainUnit)]
    steps = [e for e in events if isinstance(e.unit, StepUnit)]
    assert len(rollouts) + len(trains) + len(steps) == len(events) <= len(sched.record)

    # A worker runs one unit at a time.
    for name in roles:
        mine = sorted((e for e in events if e.worker == name), key=lambda e: e.start)
        assert all(a.end <= b.start for a, b in itertools.pairwise(mine))

    # Every group (every part of it) of every iteration rolled out exactly once, in (iteration, index) order.
    parts = cfg.group_parts
    rolled = Counter((e.unit.iteration, g, e.unit.part) for e in rollouts for g in e.unit.groups)
    assert rolled == Counter(
        {(k, g, p): 1 for k in range(first, n_iter) for g in range(n_groups) for p in range(parts)}
    )
    handed = [(u.iteration, u.index) for _, u in sched.record if isinstance(u, RolloutUnit)]
    first_hand_out = list(dict.fromkeys(handed))  # a re-queued unit is handed out again later
    assert first_hand_out == sorted(first_hand_out)
    for e in rollouts:
        u = e.unit
        if parts == 1:
            assert u.groups == tuple(range(u.index * m, (u.index + 1) * m)) and u.part == 0
        else:
            assert (u.groups, u.part, u.parts) == ((u.index // parts,), u.index % parts, parts)
        assert u.iteration - stale <= u.version <= u.iteration
        if roles[e.worker] == "trainer":
            assert cfg.tag, "a trainer rolled out without TAG"

    # A group's parts are generated with one version; its train units start only once all its parts
    # are scored (advantages are relative to the whole group).
    group_parts: dict[tuple[int, int], list[Event]] = {}
    for e in rollouts:
        for g in e.unit.groups:
            group_parts.setdefault((e.unit.iteration, g), []).append(e)
    assert all(len({e.unit.version for e in es}) == 1 for es in group_parts.values())
    for e in trains:
        assert all(e.start >= max(p.ready for p in group_parts[(e.unit.iteration, g)]) for g in e.unit.groups)

    # ... and trained exactly once per TSP rank and mini-batch, from samples at most max_staleness old.
    n_steps = cfg.optimizer_steps
    source = {e.unit.uid: e for e in rollouts}
    trained = Counter(
        (e.unit.iteration, g, source[e.unit.rollout_uid].unit.part, e.unit.tsp_rank, e.unit.step)
        for e in trains
        for g in e.unit.groups
    )
    expected = {
        (k, g, p, r, s): 1
        for k in range(first, n_iter)
        for g in range(n_groups)
        for p in range(parts)
        for r in range(degree)
        for s in range(n_steps)
    }
    assert trained == Counter(expected)
    for e in trains:
        u, src = e.unit, source[e.unit.rollout_uid]
        assert roles[e.worker] != "rollout"
        assert (u.iteration, u.groups) == (src.unit.iteration, src.unit.groups)
        assert u.sample_version == src.unit.version
        assert 0 <= u.iteration - u.sample_version <= stale
        assert u.version == u.iteration and u.tsp_degree == degree
        assert e.start >= src.ready  # never trained before its rewards are in

    # optimizer_steps steps per iteration, on every rank; step s after all of mini-batch s's train
    # units and before any of mini-batch s + 1's; only the last one publishes (version k + 1: the
    # weights are published once per iteration); the ranks take nothing else until every share is done.
    step_end: dict[int, float] = {}
    for k in range(first, n_iter):
        mine = [e for e in steps if e.unit.iteration == k]
        assert sorted((e.worker, e.unit.step) for e in mine) == sorted(
            (r, s) for r in ranks for s in range(n_steps)
        )
        assert all(e.unit.last == (e.unit.step == n_steps - 1) for e in mine)
        assert all(e.unit.version == (k + 1 if e.unit.last else k) for e in mine)
        previous_end = None
        for s in range(n_steps):
            share = [e for e in mine if e.unit.step == s]
            start, end = min(e.start for e in share), max(e.end for e in share)
            assert previous_end is None or start >= previous_end
            assert all(e.end <= start for e in trains if (e.unit.iteration, e.unit.step) == (k, s))
            # no train unit of mini-batch s + 1 (or of iteration k + 1) before step s
            assert all(
                e.start >= end
                for e in trains
                if (e.unit.iteration == k and e.unit.step > s) or e.unit.iteration == k + 1
            )
            for share_event in share:
                others = [e for e in events if e.worker == share_event.worker and e is not share_event]
                assert not [e for e in others if share_event.start <= e.start < end]
            previous_end = end
        step_end[k] = previous_end
    assert list(step_end.values()) == sorted(step_end.values())

    # A trainer rank rolls out (TAG, colocated) only while it holds a published version: after the
    # publishing step of version v - 1 and before its first step of iteration v.
    for e in rollouts:
        if roles[e.worker] == "rollout":
            continue
        v = e.unit.version
        for step_event in steps:
            same = step_event.worker == e.worker
            if same and step_event.unit.iteration == v and step_event.unit.step == 0:
                assert e.end <= step_event.start
            if same and step_event.unit.iteration == v - 1 and step_event.unit.last:
                assert e.start >= step_event.end

    for k in range(first, n_iter):
        rollout_k = [e for e in rollouts if e.unit.iteration == k]
        # Rollout of k needs version k - max_staleness: with staleness 0, it waits for step k - 1.
        # (a resumed run starts with version `first`: nothing of it is stale or waits)
        assert all(e.unit.version >= first for e in rollout_k)
        if k - stale >= first + 1:
            assert min(e.start for e in rollout_k) >= step_end[k - stale - 1]
        if cfg.barrier:
            first_train = min(e.start for e in trains if e.unit.iteration == k)
            assert first_train >= max(e.ready for e in rollout_k)

    if cfg.placement == "colocated":  # phases alternate: no rollout overlaps any training
        work = trains + steps
        assert not [(r, w) for r in rollouts for w in work if r.start < w.end and w.start < r.end]


# -- helpers -------------------------------------------------------------------------------


def fixed(rollout: float = 1.0, train: float = 0.5, step: float = 0.1) -> Duration:
    return lambda worker, unit: {RolloutUnit: rollout, TrainUnit: train, StepUnit: step}[type(unit)]


def random_durations(seed: int, ties: bool) -> Duration:
    """Per-unit random times with per-worker speeds; ``ties`` draws small integers so that
    many completions coincide."""
    rng = random.Random(seed)
    speed: dict[str, float] = {}

    def duration(worker: str, unit: Unit) -> float:
        if ties:
            return float(rng.choice([1, 2]))
        base = {RolloutUnit: 2.0, TrainUnit: 0.5, StepUnit: 0.1}[type(unit)]
        return base * speed.setdefault(worker, rng.uniform(0.5, 2.0)) * rng.uniform(0.2, 3.0)

    return duration


def pools(n_rollout: int, n_trainer: int) -> list[WorkerSpec]:
    return [WorkerSpec(f"r{i}", "rollout") for i in range(n_rollout)] + [
        WorkerSpec(f"t{i}", "trainer") for i in range(n_trainer)
    ]


def run(
    cfg: SchedulerConfig,
    workers: list[WorkerSpec],
    duration: Duration,
    scoring: Scoring | None = None,
    dies=None,
) -> list[Event]:
    sched, events = simulate(cfg, workers, duration, scoring, dies)
    check_invariants(cfg, workers, sched, events)
    return events


def of(events: list[Event], kind: type, iteration: int) -> list[Event]:
    return [e for e in events if isinstance(e.unit, kind) and e.unit.iteration == iteration]


def overlaps(a: list[Event], b: list[Event]) -> bool:
    return any(x.start < y.end and y.start < x.end for x in a for y in b)


# -- property test -------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SchedulerConfig, list[WorkerSpec]]:
    placement = draw(st.sampled_from(["colocated", "disaggregated"]))
    tag = draw(st.sampled_from([False, True, "auto"]))
    if placement == "colocated":
        workers = [WorkerSpec(f"d{i}", "both") for i in range(draw(st.integers(1, 4)))]
        stale = 0
    else:
        n_rollout = draw(st.integers(0, 4))
        workers = pools(n_rollout, draw(st.integers(1, 4)))
        tag = tag or n_rollout == 0  # trainers must be able to roll out
        stale = draw(st.integers(0, 1))
    parts = draw(st.sampled_from([1, 1, 2, 4]))  # sub-group units: a unit holds 1/parts of one group
    m = 1 if parts > 1 else draw(st.integers(1, 3))
    if parts > 1 and placement == "disaggregated" and not any(w.role == "rollout" for w in workers):
        stale = 0  # a later part may need an older version than any trainer rank holds
    cfg = SchedulerConfig(
        placement=placement,
        optimizer_steps=draw(st.integers(1, 3)),
        groups_per_iteration=m * draw(st.integers(1, 4)),
        unit_groups=m,
        group_parts=parts,
        tsp_degree=draw(st.integers(1, 3)),
        tag=tag,
        gap=draw(st.booleans()),
        max_staleness=stale,
        iterations=(n := draw(st.integers(1, 3))),
        wait_for_full_batch=draw(st.booleans()),
        start_iteration=draw(st.integers(0, n - 1)),  # a resumed run
    )
    return cfg, workers


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 2**32 - 1), ties=st.booleans())
def test_invariants_hold_on_every_mode(scenario, seed, ties):
    cfg, workers = scenario
    run(cfg, workers, random_durations(seed, ties))


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 2**32 - 1), p=st.floats(0.05, 0.6))
def test_invariants_hold_when_rollout_workers_die(scenario, seed, p):
    """Rollout workers die mid-unit, or the scores of a released unit are lost, at random
    (probability p per unit, at most once per unit, so the run ends): every group is still rolled
    out and trained exactly once; staleness and version invariants hold as before."""
    cfg, workers = scenario
    rng, failed = random.Random(seed), set()

    def dies(event):
        if event.unit.uid in failed or rng.random() >= p:
            return False
        failed.add(event.unit.uid)
        return True

    run(cfg, workers, random_durations(seed, ties=False), random_scoring(seed ^ 0x5EED, False), dies)


def test_requeued_unit_keeps_its_version_and_goes_first():
    sched = Scheduler(disagg(iterations=2, max_staleness=1), pools(2, 1))
    a, b = sched.next_unit("r0"), sched.next_unit("r1")
    sched.requeue(a)
    assert sched.next_unit("r0") == a  # the same uid, groups and version, before new units
    sched.complete(b)
    with pytest.raises(ValueError, match="not in flight"):
        sched.requeue(b)  # completed units cannot come back
    with pytest.raises(ValueError, match="only rollout units"):
        sched.requeue(StepUnit("step-0/t0", 0, 1))


def random_scoring(seed: int, ties: bool) -> Scoring:
    """Per rollout unit: scored inline (None, a third of them) or released with a random reward
    latency, from 0 (complete at the release instant) to longer than a rollout unit."""
    rng = random.Random(seed)

    def scoring(worker: str, unit: RolloutUnit) -> float | None:
        if rng.random() < 1 / 3:
            return None
        return float(rng.choice([0, 1, 2])) if ties else rng.uniform(0.0, 4.0)

    return scoring


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios(), seed=st.integers(0, 2**32 - 1), ties=st.booleans())
def test_invariants_hold_when_rewards_arrive_after_release(scenario, seed, ties):
    """Release-then-complete in random orders (reward latencies that overtake each other, tie
    with other completions, or outlast the next rollout unit): exactly once, no version mixing,
    the staleness bound, and nothing trained before its rewards are in."""
    cfg, workers = scenario
    events = run(cfg, workers, random_durations(seed, ties), random_scoring(seed ^ 0x5EED, ties))
    assert all(e.scored is None or e.scored >= e.end for e in events)


# -- worked examples -----------------------------------------------------------------------


def disagg(**kw) -> SchedulerConfig:
    base = {"placement": "disaggregated", "groups_per_iteration": 4, "unit_groups": 1}
    return SchedulerConfig(**{**base, **kw})


def test_gap_trains_before_the_last_rollout_unit_finishes():
    events = run(disagg(), pools(1, 1), fixed())
    first_train = min(e.start for e in of(events, TrainUnit, 0))
    last_rollout = max(e.end for e in of(events, RolloutUnit, 0))
    assert first_train == 1.0 < last_rollout == 4.0


@pytest.mark.parametrize("kw", [{"gap": False}, {"wait_for_full_batch": True}])
def test_barrier_holds_training_until_the_iteration_is_rolled_out(kw):
    events = run(disagg(**kw), pools(1, 1), fixed())
    assert min(e.start for e in of(events, TrainUnit, 0)) == 4.0


def test_one_step_async_overlaps_rollout_of_next_iteration_with_training():
    cfg = disagg(groups_per_iteration=2, iterations=2, max_staleness=1)
    events = run(cfg, pools(1, 1), fixed(train=1.0))
    assert overlaps(of(events, RolloutUnit, 1), of(events, TrainUnit, 0))
    assert {e.unit.sample_version for e in of(events, TrainUnit, 1)} == {0}  # one version stale


def test_on_policy_rollout_waits_for_the_step():
    cfg = disagg(groups_per_iteration=2, iterations=2)
    events = run(cfg, pools(1, 1), fixed(train=1.0))
    step_end = max(e.end for e in of(events, StepUnit, 0))
    assert min(e.start for e in of(events, RolloutUnit, 1)) == step_end
    assert {e.unit.sample_version for e in of(events, TrainUnit, 1)} == {1}


@pytest.mark.parametrize("tag", [False, True])
def test_tag_lets_an_idle_trainer_roll_out(tag):
    sched, _ = simulate(disagg(tag=tag), pools(1, 1), fixed())
    at_start = [(w, u.uid) for w, u in sched.record[:2]]
    if tag:
        assert at_start == [("r0", "rollout-0-0"), ("t0", "rollout-0-1")]
    else:
        assert at_start == [("r0", "rollout-0-0"), ("r0", "rollout-0-1")]
        assert all(w == "r0" for w, u in sched.record if isinstance(u, RolloutUnit))


def test_trainer_prefers_training_over_tag_rollout():
    sched = Scheduler(disagg(tag=True), pools(1, 1))
    first = sched.next_unit("r0")
    sched.next_unit("t0")  # TAG: rollout-0-1
    sched.complete(first)
    sched.complete(sched.record[1][1])
    unit = sched.next_unit("t0")
    assert isinstance(unit, TrainUnit) and unit.rollout_uid == "rollout-0-0"


def test_a_half_group_trains_nothing_and_a_late_half_keeps_the_groups_version():
    """One-step async, 2 parts per group: no train unit while only half of a group is in; the second
    half of iteration 1's group, handed out after step 0 published version 1, keeps version 0 (its
    first half's)."""
    sched = Scheduler(
        disagg(groups_per_iteration=1, group_parts=2, max_staleness=1, iterations=2), pools(1, 1)
    )
    first = sched.next_unit("r0")
    sched.complete(first)
    assert sched.next_unit("t0") is None  # half of group 0 is not a group: nothing to train yet
    second = sched.next_unit("r0")
    assert [(u.part, u.version) for u in (first, second)] == [(0, 0), (1, 0)]
    sched.complete(second)
    trains = []
    for _ in range(2):
        trains.append(sched.next_unit("t0"))
        sched.complete(trains[-1])
    assert [t.rollout_uid for t in trains] == ["rollout-0-0", "rollout-0-1"]
    ahead = sched.next_unit("r0")  # async: iteration 1's first half, with version 0
    assert (ahead.uid, ahead.version) == ("rollout-1-0", 0)
    sched.complete(sched.next_unit("t0"))  # the step: version 1
    assert sched.published_version == 1
    sched.complete(ahead)
    late = sched.next_unit("r0")
    assert (late.uid, late.part, late.version) == ("rollout-1-1", 1, 0)


def test_a_tag_trainer_takes_no_part_pinned_to_an_older_version():
    sched = Scheduler(
        disagg(groups_per_iteration=1, group_parts=2, tag=True, max_staleness=1, iterations=2), pools(1, 1)
    )
    for unit in [sched.next_unit("r0"), sched.next_unit("t0")]:  # iteration 0's halves, TAG takes one
        sched.complete(unit)
    ahead = sched.next_unit("r0")
    assert (ahead.uid, ahead.version) == ("rollout-1-0", 0)
    for _ in range(3):  # two train units and the step
        sched.complete(sched.next_unit("t0"))
    assert sched.published_version == 1
    assert sched.next_unit("t0") is None  # rollout-1-1 needs version 0; the trainer holds 1
    sched.complete(ahead)
    late = sched.next_unit("r0")
    assert (late.uid, late.version) == ("rollout-1-1", 0)


def test_tsp_spreads_one_unit_over_the_ranks():
    cfg = disagg(groups_per_iteration=1, tsp_degree=2)
    events = run(cfg, pools(1, 2), fixed())
    trains = of(events, TrainUnit, 0)
    placed = sorted((e.worker, e.unit.tsp_rank, e.start) for e in trains)
    assert placed == [("t0", 0, 1.0), ("t1", 1, 1.0)]


def test_colocated_alternates_phases():
    cfg = SchedulerConfig(
        placement="colocated", groups_per_iteration=4, unit_groups=1, tsp_degree=2, iterations=2
    )
    workers = [WorkerSpec("d0", "both"), WorkerSpec("d1", "both")]
    sched, events = simulate(cfg, workers, fixed())
    check_invariants(cfg, workers, sched, events)
    kinds = [type(u).__name__[0] for _, u in sched.record]
    assert [k for k, _ in itertools.groupby(kinds)] == ["R", "T", "S", "R", "T", "S"]
    assert Counter(kinds) == {"R": 8, "T": 16, "S": 4}


def test_a_rank_in_the_step_takes_nothing_else():
    # Two trainer ranks, TAG, one-step async: a rollout unit of iteration 1 is pending while
    # the step of iteration 0 is open; the rank that finished its share must still wait.
    cfg = disagg(groups_per_iteration=2, iterations=2, max_staleness=1, tag=True)
    sched = Scheduler(cfg, pools(0, 2))
    r0, r1 = sched.next_unit("t0"), sched.next_unit("t1")
    sched.complete(r0), sched.complete(r1)
    a, b = sched.next_unit("t0"), sched.next_unit("t1")
    sched.complete(a)
    tag_unit = sched.next_unit("t0")
    assert isinstance(tag_unit, RolloutUnit) and (tag_unit.iteration, tag_unit.version) == (1, 0)
    sched.complete(b)  # all of iteration 0 trained: the step opens
    step_b = sched.next_unit("t1")
    assert step_b == StepUnit(uid="step-0/t1", iteration=0, version=1)
    sched.complete(step_b)
    assert sched.next_unit("t1") is None  # rollout-1-1 is pending, but t0 owes its share
    assert sched.published_version == 0
    sched.complete(tag_unit)
    step_a = sched.next_unit("t0")
    assert isinstance(step_a, StepUnit)
    sched.complete(step_a)
    assert sched.published_version == 1 == sched.worker_version("t1")
    assert isinstance(sched.next_unit("t1"), TrainUnit)  # trained before the pending rollout


def test_rollout_worker_version_follows_its_last_unit():
    cfg = disagg(groups_per_iteration=1, iterations=2, max_staleness=1)
    sched = Scheduler(cfg, pools(1, 1))
    assert sched.worker_version("r0") == 0
    u0 = sched.next_unit("r0")
    sched.complete(u0)
    u1 = sched.next_unit("r0")  # iteration 1 with version 0: one step behind
    assert (u1.iteration, u1.version, sched.worker_version("r0")) == (1, 0, 0)


def test_record_is_in_hand_out_order():
    sched = Scheduler(disagg(), pools(2, 1))
    units = [sched.next_unit("r0"), sched.next_unit("r1")]
    assert sched.record == [("r0", units[0]), ("r1", units[1])]


def test_released_worker_generates_the_next_unit_while_the_rewards_are_scored():
    cfg = disagg(groups_per_iteration=2)
    events = run(cfg, pools(1, 1), fixed(), scoring=lambda w, u: 1.5)
    r0, r1 = sorted(of(events, RolloutUnit, 0), key=lambda e: e.start)
    assert (r0.end, r0.scored, r1.start) == (1.0, 2.5, 1.0)  # unit 1 generates while unit 0 is scored
    trains = sorted(of(events, TrainUnit, 0), key=lambda e: e.start)
    assert [t.start for t in trains] == [2.5, 3.5]  # each trained once its rewards are in


def test_release_then_complete_by_hand():
    sched = Scheduler(disagg(groups_per_iteration=2), pools(1, 1))
    u0 = sched.next_unit("r0")
    sched.release(u0)
    assert sched.next_unit("t0") is None  # no train unit before the rewards are in
    u1 = sched.next_unit("r0")  # the worker is free at once
    assert (u1.index, u1.version) == (1, 0)
    sched.complete(u1)  # rewards may arrive in any order
    assert sched.next_unit("t0").rollout_uid == u1.uid
    sched.complete(u0)
    assert sched.published_version == 0 and not sched.done()
    with pytest.raises(ValueError, match="not in flight"):
        sched.complete(u0)


def test_release_misuse_raises():
    sched = Scheduler(disagg(groups_per_iteration=1), pools(1, 1))
    unit = sched.next_unit("r0")
    sched.release(unit)
    with pytest.raises(ValueError, match="not running"):
        sched.release(unit)  # twice
    sched.complete(unit)
    with pytest.raises(ValueError, match="not running"):
        sched.release(unit)  # after complete
    train = sched.next_unit("t0")
    with pytest.raises(ValueError, match="only rollout units"):
        sched.release(train)
    never = RolloutUnit("rollout-9-9", 9, 9, (0,), 0)
    with pytest.raises(ValueError, match="not running"):
        sched.release(never)


# -- misuse and bad configuration ----------------------------------------------------------


def test_driver_misuse_raises():
    sched = Scheduler(disagg(), pools(1, 1))
    unit = sched.next_unit("r0")
    with pytest.raises(RuntimeError, match="r0"):
        sched.next_unit("r0")
    with pytest.raises(ValueError, match="unknown worker"):
        sched.next_unit("nobody")
    sched.complete(unit)
    with pytest.raises(ValueError, match="not in flight"):
        sched.complete(unit)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"unit_groups": 3}, "unit_groups"),
        ({"groups_per_iteration": 0}, "groups_per_iteration"),
        ({"unit_groups": 0}, "unit_groups"),
        ({"tsp_degree": 0}, "tsp_degree"),
        ({"iterations": -1}, "iterations"),
        ({"max_staleness": 2}, "max_staleness"),
        ({"placement": "colocated", "max_staleness": 1}, "max_staleness"),
        ({"placement": "hybrid"}, "placement"),
        ({"iterations": 2, "start_iteration": 3}, "start_iteration"),
        ({"start_iteration": -1}, "start_iteration"),
        ({"optimizer_steps": 0}, "optimizer_steps"),
        ({"group_parts": 2, "unit_groups": 2}, "unit_groups must be 1"),
        ({"group_parts": 0}, "group_parts"),
    ],
)
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        disagg(**kw)


@pytest.mark.parametrize(
    ("cfg", "workers"),
    [
        (disagg(), pools(0, 1)),  # nobody can roll out
        (disagg(), pools(2, 0)),  # nobody trains
        (disagg(tag=True), [WorkerSpec("d0", "both")]),
        (
            disagg(tag=True, group_parts=2, max_staleness=1),
            pools(0, 1),
        ),  # a later part may need older weights
        (SchedulerConfig(placement="colocated", groups_per_iteration=4, unit_groups=1), pools(1, 1)),
        (disagg(), []),
        (disagg(), [WorkerSpec("a", "rollout"), WorkerSpec("a", "trainer")]),
    ],
)
def test_bad_pools_raise(cfg, workers):
    with pytest.raises(ValueError, match="worker"):
        Scheduler(cfg, workers)


def test_tag_alone_makes_trainers_a_rollout_pool():
    run(disagg(tag=True, iterations=2, tsp_degree=2), pools(0, 3), fixed())


# -- mini-batch PPO ------------------------------------------------------------------------


def test_minibatch_steps_follow_their_train_units_and_only_the_last_publishes():
    cfg = disagg(groups_per_iteration=2, optimizer_steps=2, iterations=2)
    sched, events = simulate(cfg, pools(1, 1), fixed())
    check_invariants(cfg, pools(1, 1), sched, events)
    trainer = [u for w, u in sched.record if w == "t0"]
    # mini-batch 0 of each rollout unit as it arrives (GAP), its step, then mini-batch 1
    assert [(type(u).__name__[0], u.iteration, u.step) for u in trainer] == [
        ("T", 0, 0),
        ("T", 0, 0),
        ("S", 0, 0),
        ("T", 0, 1),
        ("T", 0, 1),
        ("S", 0, 1),
        ("T", 1, 0),
        ("T", 1, 0),
        ("S", 1, 0),
        ("T", 1, 1),
        ("T", 1, 1),
        ("S", 1, 1),
    ]
    assert [u.uid for u in trainer[:2]] == ["train-0-0-0.0", "train-0-1-0.0"]
    step_units = [u for u in trainer if isinstance(u, StepUnit)]
    assert [(u.uid, u.version, u.last) for u in step_units] == [
        ("step-0.0/t0", 0, False),
        ("step-0.1/t0", 1, True),
        ("step-1.0/t0", 1, False),
        ("step-1.1/t0", 2, True),
    ]
    # the rollout worker only ever sees published versions: 0 for iteration 0, 1 for iteration 1
    assert [u.version for w, u in sched.record if w == "r0"] == [0, 0, 1, 1]
    # GAP: mini-batch 0 of the first unit trains while the second one generates
    assert min(e.start for e in of(events, TrainUnit, 0)) < max(e.end for e in of(events, RolloutUnit, 0))


def test_a_trainer_past_the_first_step_takes_no_tag_rollout():
    """One-step async with TAG: while iteration 0's later mini-batches train, a rollout unit of
    iteration 1 (version 0 allowed) is pending; a trainer that has stepped holds no published
    version, so only the rollout worker takes it."""
    cfg = disagg(groups_per_iteration=6, optimizer_steps=2, tag=True, max_staleness=1, iterations=2)
    sched, events = simulate(cfg, pools(1, 2), fixed(rollout=1.0, train=0.2))
    check_invariants(cfg, pools(1, 2), sched, events)
    first, last = (min(e.start for e in of(events, StepUnit, 0)), max(e.end for e in of(events, StepUnit, 0)))
    assert any(e.start < last and e.end > first for e in of(events, RolloutUnit, 1))  # rollout goes on
    assert not [
        e for e in events if e.worker != "r0" and isinstance(e.unit, RolloutUnit) and first <= e.start < last
    ]
    assert any(
        e.worker != "r0" for e in of(events, RolloutUnit, 0) + of(events, RolloutUnit, 1)
    )  # TAG otherwise


def test_minibatches_with_tag_alone_and_tsp():
    run(disagg(optimizer_steps=3, tag=True, tsp_degree=2, iterations=2), pools(0, 2), fixed())
