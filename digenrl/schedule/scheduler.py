"""The scheduling policy: which unit of work each worker does next. Pure Python (no Ray, torch or
clock): the Ray runtime and the planner's simulator drive it through one loop
(:func:`~digenrl.schedule.driver.drive`). Versions, mini-batch steps and every knob (placement,
GAP, TSP, TAG, staleness, sub-group units): docs/architecture.md, "The engine"."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

from digenrl.schedule.knobs import SchedulingKnobs
from digenrl.units.types import Role, RolloutUnit, StepUnit, TrainUnit, Unit, WorkerSpec

Placement = Literal["colocated", "disaggregated"]


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulingKnobs):
    """The knobs (:class:`~digenrl.schedule.knobs.SchedulingKnobs`: unit_groups, group_parts, tsp_degree,
    tag, gap, max_staleness) plus the run's work; keyword arguments only."""

    placement: Placement
    groups_per_iteration: int  # prompts per iteration; each prompt is one group of G samples
    iterations: int = 1
    wait_for_full_batch: bool = False  # train units wait for the whole iteration's rollout
    start_iteration: int = 0  # resume: iterations already done (the published version to start from)
    optimizer_steps: int = 1  # mini-batch PPO: collective steps per iteration (the last one publishes)

    def __post_init__(self) -> None:
        if self.placement not in ("colocated", "disaggregated"):
            raise ValueError(f"placement must be 'colocated' or 'disaggregated', got {self.placement!r}")
        for name in (
            "groups_per_iteration",
            "unit_groups",
            "tsp_degree",
            "iterations",
            "group_parts",
            "optimizer_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.groups_per_iteration % self.unit_groups:
            raise ValueError(
                f"unit_groups ({self.unit_groups}) must divide "
                f"groups_per_iteration ({self.groups_per_iteration})"
            )
        if self.group_parts > 1 and self.unit_groups != 1:
            raise ValueError(
                f"unit_groups must be 1 with group_parts {self.group_parts} (a unit holds part of "
                f"one group), got {self.unit_groups}"
            )
        if isinstance(self.start_iteration, bool) or not 0 <= self.start_iteration <= self.iterations:
            raise ValueError(
                f"start_iteration must be in 0..iterations ({self.iterations}), got {self.start_iteration!r}"
            )
        if not (isinstance(self.tag, bool) or self.tag == "auto"):
            raise ValueError(f"tag must be False, True or 'auto', got {self.tag!r}")
        if self.max_staleness not in (0, 1):
            raise ValueError(f"max_staleness must be 0 or 1, got {self.max_staleness!r}")
        if self.placement == "colocated" and self.max_staleness:
            raise ValueError(
                "max_staleness must be 0 with placement 'colocated' "
                "(the devices cannot roll out while they train)"
            )

    @property
    def units_per_iteration(self) -> int:
        return self.groups_per_iteration // self.unit_groups * self.group_parts

    @property
    def barrier(self) -> bool:
        """True when train units of iteration k wait until all of k is rolled out."""
        return self.placement == "colocated" or not self.gap or self.wait_for_full_batch


class Scheduler:
    """Hands out units one at a time; the state changes only in ``next_unit``, ``release`` and
    ``complete``.

    Raises on driver misuse (unknown worker, a busy worker asking, a unit completed twice)
    rather than guessing, since a silent slip here would corrupt versions.
    """

    def __init__(self, cfg: SchedulerConfig, workers: list[WorkerSpec], elastic=None) -> None:
        """``elastic``: with ``tag: auto``, the advisor (:class:`~digenrl.schedule.bts.Elastic`) that
        decides each TAG point and hears every hand-out and completion (without one, auto is on)."""
        self.cfg = cfg
        self.elastic = elastic
        self._roles: dict[str, Role] = {}
        for w in workers:
            if w.role not in ("rollout", "trainer", "both"):
                raise ValueError(
                    f"worker {w.name!r}: role must be 'rollout', 'trainer' or 'both', got {w.role!r}"
                )
            if w.name in self._roles:
                raise ValueError(f"worker names must be unique, {w.name!r} appears twice")
            self._roles[w.name] = w.role
        self._check_pools()
        # Trainer ranks: they train and all take part in every optimizer step.
        self._ranks = frozenset(n for n, r in self._roles.items() if r != "rollout")

        # optimizer steps completed; a resumed run starts at its checkpoint's version, with an empty
        # pipeline: nothing generated before the stop is trained after it
        self.published_version = cfg.start_iteration
        self.record: list[tuple[str, Unit]] = []  # (worker, unit) in hand-out order
        self._in_flight: dict[str, str] = {}  # unit uid -> worker running it
        self._released: set[str] = set()  # rollout units generated, their rewards not yet in
        self._rollout_version = {n: cfg.start_iteration for n, r in self._roles.items() if r == "rollout"}

        n = cfg.iterations
        self._next_rollout = (cfg.start_iteration, 0)  # (iteration, index) of the next rollout unit
        self._rolled_out = [0] * n  # completed rollout units per iteration
        self._behind_barrier: list[list[TrainUnit]] = [[] for _ in range(n)]
        S = cfg.optimizer_steps
        self._ready: list[list[deque[TrainUnit]]] = [[deque() for _ in range(S)] for _ in range(n)]  # [k][s]
        per_minibatch = cfg.units_per_iteration * cfg.tsp_degree
        self._train_left = [[per_minibatch] * S for _ in range(n)]  # [k][s]: not yet complete
        # Mini-batch of iteration published_version being trained: the steps of it already taken.
        self.minibatch = 0
        # Ranks that have not finished the open optimizer step (of iteration published_version,
        # mini-batch ``minibatch``); non-empty exactly while a step is open.
        self._step_unfinished: set[str] = set()
        self._retry: deque[RolloutUnit] = deque()  # re-queued rollout units, handed out first
        self._group_version: dict[tuple[int, int], int] = {}  # sub-group units: (iteration, group) -> version
        self._parts_done: dict[
            tuple[int, int], dict[int, list[TrainUnit]]
        ] = {}  # ... -> part -> its train units

    def _check_pools(self) -> None:
        roles = set(self._roles.values())
        if not roles:
            raise ValueError("workers: at least one worker is required")
        if self.cfg.placement == "colocated":
            if roles != {"both"}:
                raise ValueError("workers: placement 'colocated' needs every worker to have role 'both'")
            return
        if "both" in roles:
            raise ValueError("workers: role 'both' is only valid with placement 'colocated'")
        if "trainer" not in roles:
            raise ValueError("workers: placement 'disaggregated' needs at least one 'trainer' worker")
        if "rollout" not in roles and not self.cfg.tag:
            raise ValueError(
                "workers: placement 'disaggregated' needs a 'rollout' worker, "
                "or tag=True so that trainers roll out"
            )
        if "rollout" not in roles and self.cfg.group_parts > 1 and self.cfg.max_staleness:
            raise ValueError(
                "workers: sub-group units with max_staleness 1 need a 'rollout' worker (a group's later "
                "parts may need an older version than a trainer rank holds)"
            )

    # -- the two calls -------------------------------------------------------------------

    def next_unit(self, worker: str) -> Unit | None:
        role = self._role(worker)
        if worker in self._in_flight.values():
            raise RuntimeError(f"worker {worker!r} asked for work while it still runs a unit")
        unit = self._pick(worker, role)
        if unit is not None:
            self._in_flight[unit.uid] = worker
            self.record.append((worker, unit))
            if isinstance(unit, RolloutUnit) and role == "rollout":
                self._rollout_version[worker] = unit.version  # it syncs before starting
            if self.elastic is not None:
                self.elastic.started(worker, unit)
        return unit

    def release(self, unit: RolloutUnit) -> None:
        """The worker of rollout ``unit`` is free (it generated the samples and handed them to
        the reward service), but the unit's output is not usable yet: nothing is trained from
        it until ``complete(unit)``. Changes no version and releases no train unit."""
        if not isinstance(unit, RolloutUnit):
            raise ValueError(f"only rollout units can be released, got {unit.uid!r}")
        if self._in_flight.pop(unit.uid, None) is None:
            raise ValueError(
                f"unit {unit.uid!r} is not running (never handed out, released or completed already)"
            )
        self._released.add(unit.uid)
        if self.elastic is not None:
            self.elastic.released_unit(unit)

    def complete(self, unit: Unit, result: object = None) -> None:
        """Mark ``unit`` done (running or released). ``result`` is the driver's payload; the
        policy does not read it."""
        worker = self._in_flight.pop(unit.uid, None)
        if worker is None and unit.uid in self._released:
            self._released.discard(unit.uid)
            worker = ""  # a released unit holds no worker
        if worker is None:
            raise ValueError(f"unit {unit.uid!r} is not in flight (never handed out, or completed twice)")
        if self.elastic is not None:
            self.elastic.completed(unit)
        if isinstance(unit, RolloutUnit):
            self._rollout_done(unit)
        elif isinstance(unit, TrainUnit):
            self._train_done(unit)
        else:
            self._step_unfinished.discard(worker)
            if not self._step_unfinished:  # the last rank finished the step
                if self.minibatch == self.cfg.optimizer_steps - 1:  # the iteration's last: publish
                    self.published_version += 1
                    self.minibatch = 0
                else:
                    self.minibatch += 1

    def requeue(self, unit: RolloutUnit) -> None:
        """A rollout unit whose worker died (running), or whose scores were lost (released): hand
        it out again whole, with its original uid, groups and version (the trajectory is generated
        again from its first step, never resumed halfway). It goes before any new rollout unit; a
        rollout worker loads that version; a TAG trainer rank, which only holds the newest
        weights, generates it with those (newer, so within the staleness bound)."""
        if not isinstance(unit, RolloutUnit):
            raise ValueError(
                f"only rollout units can be re-queued, not {unit.uid!r} (a trainer rank holds state)"
            )
        if self._in_flight.pop(unit.uid, None) is None:
            if unit.uid not in self._released:
                raise ValueError(f"unit {unit.uid!r} is not in flight (never handed out, or completed)")
            self._released.discard(unit.uid)
        self._retry.append(unit)
        if self.elastic is not None:
            self.elastic.forget(unit)

    def done(self) -> bool:
        return self.published_version == self.cfg.iterations

    def worker_version(self, worker: str) -> int:
        """Policy version the worker holds: trainer ranks hold the published weights (after
        ``minibatch`` intermediate steps of the next iteration), rollout workers the version of
        the last unit they were handed (the start version before any)."""
        if self._role(worker) == "rollout":
            return self._rollout_version[worker]
        return self.published_version

    # -- policy --------------------------------------------------------------------------

    def _pick(self, worker: str, role: Role) -> Unit | None:
        if role == "rollout":
            return self._take_rollout(any_version=True)
        # A trainer rank: own step > train unit > (TAG or colocated) rollout unit.
        if self._step_unfinished:
            # The step is collective: until every rank finished it, a rank takes nothing else.
            # An idle rank still in the set has not been handed its share yet (a rank running
            # it is in flight and cannot ask).
            if worker not in self._step_unfinished:
                return None
            return self._step_unit(worker)
        # Only iteration published_version can train: its train units need exactly those weights,
        # and only its current mini-batch: the others need the weights after the step before them.
        k, s = self.published_version, self.minibatch
        if k < self.cfg.iterations and self._ready[k][s]:
            return self._ready[k][s].popleft()
        if (role == "both" or self.cfg.tag) and s == 0:  # it holds the published version k
            if role == "trainer" and self.cfg.tag == "auto" and self.elastic is not None:
                return self._elastic_rollout(worker)
            return self._take_rollout()
        return None

    def _elastic_rollout(self, worker: str) -> RolloutUnit | None:
        """``tag: auto``: a rollout unit only where BTS predicts that taking it ends sooner."""
        if not self._rollout_pending() or not self.elastic.insert(self, worker):
            return None
        unit = self._take_rollout()
        self.elastic.taken(worker, unit)
        return unit

    def _rollout_pending(self) -> bool:
        """Whether a trainer rank's ``_take_rollout()`` would hand out a unit (changes nothing)."""
        pv = self.published_version
        if any(u.parts == 1 or u.version == pv for u in self._retry):
            return True
        k, j = self._next_rollout
        if k >= self.cfg.iterations or pv < k - self.cfg.max_staleness:
            return False
        parts = self.cfg.group_parts
        return parts == 1 or self._group_version.get((k, j // parts), pv) == pv

    def fork(self) -> Scheduler:
        """A copy of the policy's state that the copy's calls do not share (BTS plays it forward):
        no record, no advisor. The past iterations' rows, which nothing changes, are shared."""
        new = object.__new__(Scheduler)
        new.__dict__.update(self.__dict__)
        pv = self.published_version
        new.elastic, new.record = None, []
        new._in_flight, new._released = dict(self._in_flight), set(self._released)
        new._rollout_version, new._step_unfinished = dict(self._rollout_version), set(self._step_unfinished)
        new._rolled_out = list(self._rolled_out)
        new._behind_barrier = self._behind_barrier[:pv] + [list(x) for x in self._behind_barrier[pv:]]
        new._ready = self._ready[:pv] + [[deque(d) for d in row] for row in self._ready[pv:]]
        new._train_left = self._train_left[:pv] + [list(x) for x in self._train_left[pv:]]
        new._retry, new._group_version = deque(self._retry), dict(self._group_version)
        new._parts_done = {key: dict(held) for key, held in self._parts_done.items()}
        return new

    def _step_unit(self, worker: str) -> StepUnit:
        k, s, S = self.published_version, self.minibatch, self.cfg.optimizer_steps
        uid = f"step-{k}/{worker}" if S == 1 else f"step-{k}.{s}/{worker}"
        last = s == S - 1
        return StepUnit(uid=uid, iteration=k, version=k + 1 if last else k, step=s, last=last)

    def _take_rollout(self, any_version: bool = False) -> RolloutUnit | None:
        """The next rollout unit: a re-queued one first (for a trainer rank, stamped with the newest
        version, the one it holds), else the next new one. ``any_version``: the asking worker can
        load any version (a rollout worker); a trainer rank cannot take a part of a group pinned
        to an older version."""
        for unit in self._retry:
            if any_version or unit.parts == 1 or unit.version == self.published_version:
                self._retry.remove(unit)
                return (
                    unit if any_version or unit.parts > 1 else replace(unit, version=self.published_version)
                )
        k, j = self._next_rollout
        if k >= self.cfg.iterations or self.published_version < k - self.cfg.max_staleness:
            return None
        m, parts = self.cfg.unit_groups, self.cfg.group_parts
        if parts == 1:
            groups, part, version = tuple(range(j * m, (j + 1) * m)), 0, self.published_version
        else:  # part j % parts of group j // parts, with the version of the group's first part
            g, part = divmod(j, parts)
            groups = (g,)
            version = self._group_version.setdefault((k, g), self.published_version)
            if not any_version and version != self.published_version:
                return None  # a rollout worker will take it
        self._next_rollout = (k, j + 1) if j + 1 < self.cfg.units_per_iteration else (k + 1, 0)
        return RolloutUnit(
            uid=f"rollout-{k}-{j}",
            iteration=k,
            index=j,
            groups=groups,
            version=version,
            part=part,
            parts=parts,
        )

    def _rollout_done(self, unit: RolloutUnit) -> None:
        """Turn the rolled-out groups into one train unit per mini-batch and TSP rank (a slice of
        each group's samples, a residue class of the trained timesteps)."""
        k, degree, S = unit.iteration, self.cfg.tsp_degree, self.cfg.optimizer_steps
        new = [
            TrainUnit(
                uid=f"train-{k}-{unit.index}-{r}" if S == 1 else f"train-{k}-{unit.index}-{r}.{s}",
                iteration=k,
                rollout_uid=unit.uid,
                groups=unit.groups,
                sample_version=unit.version,
                tsp_rank=r,
                tsp_degree=degree,
                version=k,
                step=s,
            )
            for s in range(S)
            for r in range(degree)
        ]
        self._rolled_out[k] += 1
        if unit.parts > 1:  # a group trains only once all its parts are in (advantages need the whole group)
            held = self._parts_done.setdefault((k, unit.groups[0]), {})
            held[unit.part] = new
            if len(held) < unit.parts:
                return
            new = [t for p in sorted(held) for t in held[p]]  # in part order
            del self._parts_done[(k, unit.groups[0])], self._group_version[(k, unit.groups[0])]
        # Train queues are FIFO: oldest (earliest rolled-out) first.
        if not self.cfg.barrier:
            for t in new:  # GAP: train while later units still generate
                self._ready[k][t.step].append(t)
        else:
            self._behind_barrier[k].extend(new)
            if self._rolled_out[k] == self.cfg.units_per_iteration:
                for t in self._behind_barrier[k]:
                    self._ready[k][t.step].append(t)
                self._behind_barrier[k].clear()

    def _train_done(self, unit: TrainUnit) -> None:
        self._train_left[unit.iteration][unit.step] -= 1
        if self._train_left[unit.iteration][unit.step] == 0:
            # Every gradient of the mini-batch is accumulated: open its collective step. (Train
            # units of k, s only run at published_version == k and minibatch == s: this is that step.)
            self._step_unfinished = set(self._ranks)

    def _role(self, worker: str) -> Role:
        try:
            return self._roles[worker]
        except KeyError:
            raise ValueError(f"unknown worker {worker!r}") from None
