"""The Ray runtime: a run of the engine, the scheduler's decisions carried out by Ray actors.
:func:`run_on_ray` starts the workers and drives the loop; :class:`RayBackend` is the dispatcher --
one Ray call per unit, the first result reported -- and only moves data. What results mean for an
iteration is the ledger's (:mod:`~digenrl.engine.ledger`), what a dead process means the fault
recovery's (:mod:`~digenrl.engine.recovery`): docs/architecture.md, "The Ray runtime"."""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

from digenrl.config.run import RunConfig
from digenrl.engine import head_watch
from digenrl.engine.around_steps import AroundSteps
from digenrl.engine.cluster import (
    REWARD_ROW,
    form_rollout_sp_group,
    form_sync_group,
    num_restarts,
    ray_workers,
)
from digenrl.engine.ledger import IterationLedger
from digenrl.engine.recovery import (
    FaultRecovery,
    GroupRestart,
    TrainerLost,
    user_errors,
)
from digenrl.engine.stall import StallWatch
from digenrl.engine.timeline import SERVICE_POOL, Timeline
from digenrl.engine.weight_sync import SyncRoutes
from digenrl.engine.workers import SCORE_GROUP
from digenrl.errors import WeightSyncError, actor_died, first_line
from digenrl.placement.layout import RunLayout
from digenrl.progress import progress
from digenrl.run.cadence import (
    RunCadence,
    RunResult,
    StopRequest,
    resume_history,
    stop_on_interrupt,
    write_final,
)
from digenrl.run.rundir import RunDir, check_writable, default_run_dir
from digenrl.schedule.bts import BTS_KEYS, elastic_for
from digenrl.schedule.driver import Done, Event, Lost, Released, Scored, drive
from digenrl.schedule.scheduler import Scheduler
from digenrl.units.types import RolloutUnit, StepUnit, TrainUnit, Unit

# ------------------------------------------------------------------------------ the run


def run_on_ray(
    cfg: RunConfig,
    layout: RunLayout,
    resumed=None,
    run_dir: Path | None = None,
    on_iteration: Callable[[dict], None] | None = None,
    ray_address: str | None = None,
) -> RunResult:
    """Train ``cfg`` on Ray as its resolved ``layout`` says (:func:`digenrl.launch.run_engine`
    resolves it and checks what the workers will build first).

    Writes the same run directory as :meth:`LocalTrainer.run` plus ``layout.json``,
    ``timeline.json`` and ``timeline.png``. ``ray_address`` joins an existing cluster; without it a
    local one is started (or the one this process is already connected to is used). Ray is shut
    down, and every actor killed, on return and on any exception.

    ``resumed`` (a checkpoint's state) starts every worker from that checkpoint -- weights, version,
    optimizer and RNG states -- with an empty pipeline: a rollout of a later iteration that was
    generated (async mode) but not trained before the stop is generated again with the
    checkpoint's weights, so no sample is trained twice. A resumed run appends to the checkpoint's
    run directory unless ``run_dir`` forks it elsewhere.
    """
    start = resumed.iteration if resumed is not None else 0
    sched_cfg = layout.scheduler_config(start)  # tag auto: BTS measures unit times on the wall clock
    priors = {(k, w): s for k, w, s in layout.bts_priors}  # the cost model's, until the run measures
    elastic = elastic_for(sched_cfg, layout.scheduled, time.time, priors)
    scheduler = Scheduler(sched_cfg, layout.scheduled, elastic)
    run_dir, history = resume_history(resumed, run_dir)
    check_writable(run_dir or cfg.output.run_dir or default_run_dir(cfg), "output.run_dir")
    if resumed is not None and start == cfg.train.iterations:  # finished already: nothing to do
        return RunResult(Path(run_dir), history)
    started = time.time()  # the timeline starts here: Ray and the workers starting up are its first events
    with user_errors(), ray_workers(cfg, layout, ray_address, resumed and resumed.path) as actors:
        sync = form_sync_group(layout, actors)  # before the run directory: its errors are the user's
        progress(f"{len(layout.workers)} workers ready ({time.time() - started:.0f} s)...")
        out = RunDir(cfg, run_dir, history=history)
        layout.write(out.path)
        backend = None
        routes = SyncRoutes(*sync[:2], start, actors, layout.trainer_ranks[0], store=sync[2])
        routes.reform = lambda: form_sync_group(layout, actors)  # the weight-sync group, after a restart
        sp_rollout = {names[0]: names for names in layout.rollout_sp_groups}  # restarted whole
        form = lambda names: form_rollout_sp_group(actors, names)  # noqa: E731
        stall = StallWatch.of(layout, actors, cfg.engine.stall_timeout_s)  # a stalled member: its group down
        groups = GroupRestart(sp_rollout, actors, form, cfg.engine.group_timeout_s, stall)
        try:
            with stop_on_interrupt() as stop:
                backend = RayBackend(
                    cfg,
                    layout,
                    scheduler,
                    actors,
                    out,
                    on_iteration=on_iteration,
                    history=history,
                    t0=started,
                    sync=routes,
                    stop=stop,
                    groups=groups,
                    resumed_at=start
                    if resumed is not None
                    else None,  # timeline.json: after the earlier part
                )
                try:
                    backend.begin()
                    drive(scheduler, [w.name for w in layout.scheduled], backend)
                    backend.drain()  # the last eval / checkpoint
                except BaseException as exc:  # Ctrl-C, or a fatal error: keep what can be kept
                    raise backend.keep_work(exc) from None
            write_final(out.path, backend.final_files())
        finally:
            progress("stopping workers...")  # the `with` releases them next (Ray shutdown: seconds)
            if backend is not None:
                backend.save_timeline()
            out.close()
    return RunResult(out.path, backend.ledger.rows)


# ---------------------------------------------------------------------- the dispatcher


class RayBackend(AroundSteps):
    """The driver loop's backend on Ray: one call per unit on its worker's actor, results reported
    one at a time (``ray.wait(num_returns=1)``). Rank 0's side calls (eval, checkpoint) and
    restarting workers' ready() calls are waited on beside the units."""

    def __init__(
        self,
        cfg: RunConfig,
        layout: RunLayout,
        scheduler: Scheduler,
        actors: dict,
        out: RunDir | None,
        *,
        on_iteration: Callable[[dict], None] | None = None,
        history: list[dict] | None = None,
        t0: float | None = None,
        sync: SyncRoutes | None = None,
        stop: StopRequest | None = None,
        resumed_at: int | None = None,
        groups: GroupRestart | None = None,
    ):
        """``t0``: the run's start (the timeline's zero; default now); ``sync``: the weight-sync
        routes (default: the object store); ``stop``: the Ctrl-C request (default: never asked);
        ``resumed_at``: a resumed run's first iteration (its timeline continues the earlier part's);
        ``groups``: the engine.rollout_sp groups, each restarted whole on a lost member (default: none)."""
        workers = layout.workers
        self.cfg, self.sched, self.actors, self.out, self.cadence = (
            cfg,
            scheduler,
            actors,
            out,
            RunCadence(cfg),
        )
        self.role = {w.name: w.role for w in workers}
        self.rank0 = layout.trainer_ranks[0]
        self.publishes = any(w.role == "rollout" for w in workers)  # rank 0 ships weights after each step
        self.timeline = Timeline()
        leads = layout.leads  # a follower device is busy while its lead is
        for w in workers:
            self.timeline.add_worker(w.name, w.pool.name, follows=leads.get(w.name))
        if cfg.reward.service is not None:
            self.timeline.add_worker(REWARD_ROW, SERVICE_POOL)
        self.faults = FaultRecovery(self.role, cfg.engine.max_restarts)
        self.ledger = IterationLedger(
            cfg,
            scheduler.cfg,
            self.timeline,
            out,
            on_iteration,
            history,
            restarts=lambda: sum(self.faults.restarts.values()) + num_restarts(actors.get(REWARD_ROW)),
        )
        self.t0 = time.time() if t0 is None else t0
        self.resumed_at = resumed_at  # a resumed run's first iteration (see save_timeline)
        # ObjectRef -> (worker, unit): a unit running, or the scores of a released one
        self.in_flight: dict = {}
        # ObjectRef -> (what, iteration or worker): rank 0's eval / checkpoint, a ready()
        self.side: dict = {}
        self.samples: dict[str, object] = {}  # rollout uid -> ObjectRef of its Samples, until fully trained
        self.trained: Counter[str] = Counter()  # rollout uid -> TSP shares trained
        self.unscored: dict[str, dict] = {}  # released rollout uid -> its summary, until the scores arrive
        self.score_row: dict[str, str] = {}  # released rollout uid -> the rollout worker scoring it after it
        self.scorers = [w.name for w in workers if w.role == "rollout" and w.name not in layout.sp_followers]
        self.sync = sync or SyncRoutes("object_store", [], scheduler.published_version, actors, self.rank0)
        self.rank_checksums: dict[int, set[str]] = defaultdict(set)
        self.hidden = layout.hidden  # followers: their lead runs their calls (not scheduled)
        self.step_shares: dict[tuple[int, int], set[str]] = defaultdict(
            set
        )  # (iteration, step) -> ranks handed it
        self.stop = stop or StopRequest()  # Ctrl-C
        self.stopping = False  # after Ctrl-C or a fatal error: no new work, the running units finish
        self.groups = groups or GroupRestart({}, actors, None)  # engine.rollout_sp groups

    def begin(self) -> None:
        """Before the first unit: the starting weights every restarted worker must hold, and (for a
        re-queued unit of the starting version) rank 0's packet of them."""
        import ray

        head_watch.explain(self.explained)  # its last resort, too, names how to resume
        for w in self.role:  # start-up: from the run's start until every worker was ready
            self.timeline.record(w, "start", f"start-{w}", 0, 0, 0.0, time.time() - self.t0)
        rank0 = self.actors[self.rank0]
        self.faults.start_checksum = ray.get(rank0.ready.remote())["checksum"]
        if self.publishes:
            self.sync.begin()
            progress("first weights published; generating the first rollouts...")
        else:
            progress("generating the first rollouts...")

    # -- start: one Ray call per unit ------------------------------------------------------

    def start(self, worker: str, unit: Unit) -> None:
        actor = self.actors[worker]
        if isinstance(unit, RolloutUnit):
            # rollout workers swap to the unit's version first (trainer ranks already hold it)
            packet = (
                self.sync.for_rollout(worker, unit, self.sched.published_version)
                if self.role[worker] == "rollout"
                else None
            )
            samples, ref = actor.rollout.options(num_returns=2).remote(unit, packet)
            self.samples[unit.uid] = samples
        elif isinstance(unit, TrainUnit):
            ref = actor.train.remote(
                unit,
                self.samples[unit.rollout_uid],
                self.ledger.advantages(unit),
                self.ledger.minibatch_terms(unit.iteration),
            )
        else:  # only the iteration's last optimizer step publishes
            publish = worker == self.rank0 and self.publishes and unit.last
            ref = actor.step.remote(unit, self.sync.step_arg(unit) if publish else False)
            self.step_shares[(unit.iteration, unit.step)].add(worker)
        self.in_flight[ref] = (worker, unit)

    # -- the next event ----------------------------------------------------------------------

    def next_event(self) -> Event | None:
        if self.stop.requested and not self.stopping:  # Ctrl-C: leave the driver loop between events
            raise KeyboardInterrupt
        if not self.stopping:
            return self._next_event()
        self.faults.restarting.clear()  # stopping: a dead rollout worker is not waited for
        try:
            return self._next_event()
        except (TrainerLost, WeightSyncError):
            raise
        except Exception as exc:  # noqa: BLE001 -- stopping: that unit's work is lost, the rest goes on
            print(f"warning: a unit failed while stopping: {first_line(exc, typed=True)}", file=sys.stderr)
            return None

    def _next_event(self) -> Event | None:
        import ray

        for worker in self.faults.due_for_ready():
            self.side[self.actors[worker].ready.remote()] = ("restart", worker)
        if not self.in_flight and not self.side and not self.faults.restarting:
            raise RuntimeError(f"engine stalled: nothing in flight at version {self.sched.published_version}")
        ready, _ = ray.wait([*self.in_flight, *self.side], num_returns=1, timeout=self.faults.wait_timeout())
        self.faults.check_head()
        self.groups.watch(self.in_flight, self.role, self.side_busy())  # a blocked or stalled member
        if not ready:
            return None
        ref = ready[0]
        if ref in self.side:
            return self.side_done(ref)
        worker, unit = self.in_flight.pop(ref)
        try:
            result = ray.get(ref)
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.RayTaskError,
            ray.exceptions.ObjectLostError,
        ) as exc:
            if not actor_died(exc):
                raise
            self.samples.pop(unit.uid, None)
            if self.score_row.pop(unit.uid, None) is not None:  # its scorer died: generate it again
                self.unscored.pop(unit.uid, None)
                return Lost(unit)
            # the unit goes back to the scheduler, or the run stops (naming the stall it was taken down for)
            lost = self.faults.died(worker, unit, self.groups.cause(worker, exc))
            self.sync.worker_died(worker, self.sched.published_version)  # a rollout worker leaves the group
            self.groups.take_down(worker, exc)  # engine.rollout_sp: the rest of its group restarts too
            return lost
        if worker == REWARD_ROW:  # the scores of a released rollout unit: now it is complete
            self.scored(unit, result)
            return Scored(unit)
        if isinstance(unit, RolloutUnit) and "missed" in result:  # the group went down without its version:
            self.sync.missed(worker, unit, self.sched.published_version)  # again, with rank 0's copy
            self.start(worker, unit)
            return None
        self.record(worker, result["events"])
        if isinstance(unit, RolloutUnit):
            if "reward_ref" in result:  # scored by the reward service: the worker is free, the unit not done
                self.unscored[unit.uid] = result
                self.in_flight[result["reward_ref"]] = (REWARD_ROW, unit)
                return Released(worker, unit)
            if "score_on" in result or "decoded" in result:  # a model reward: scored after the unit
                self.score_after(unit, result)
                return Released(worker, unit)
            self.unscored[unit.uid], self.score_row[unit.uid] = result, worker  # scored inline, on its row
            self.scored(unit, result.pop("scores"), inline=True)
        elif isinstance(unit, TrainUnit):
            self.ledger.trained(unit, result["stats"])
            self.trained[unit.rollout_uid] += 1
            if (
                self.trained[unit.rollout_uid] == unit.tsp_degree * self.sched.cfg.optimizer_steps
            ):  # all trained
                del self.samples[unit.rollout_uid]
        elif isinstance(unit, StepUnit):
            self.step_done(worker, unit, result)
        return Done(worker, unit)

    def record(self, worker: str, events: list[dict]) -> None:
        """A worker's timeline events (absolute times, measured where they ran) relative to the run start."""
        for ev in events:
            if (bts := self.sched.elastic) is not None:  # tag auto: BTS's predictions, then their errors
                ev["args"] = {**ev["args"], **bts.event_args(*(ev[k] for k in BTS_KEYS))}
            self.timeline.record(
                worker,
                ev["kind"],
                ev["uid"],
                ev["iteration"],
                ev["version"],
                ev["start"] - self.t0,
                ev["end"] - self.t0,
                ev.get("sample_versions", ()),
                **ev["args"],
            )

    def step_done(self, worker: str, unit: StepUnit, result: dict) -> None:
        """One rank's share of the step: rank 0 reports the gradient norm and publishes; every rank's
        weights must be the same afterwards."""
        if worker == self.rank0:
            self.ledger.stepped(unit.iteration, result["grad_norm"])
            if unit.last and self.publishes:
                self.sync.stepped(unit, result, self.sched.published_version)
        if result["checksum"] is not None:
            after = (unit.iteration, unit.step)
            self.rank_checksums[after].add(result["checksum"])
            if len(self.rank_checksums[after]) > 1:
                raise WeightSyncError(f"trainer ranks hold different weights after step {unit.iteration}")

    def score_after(self, unit: RolloutUnit, result: dict) -> None:
        """A model reward (:func:`~digenrl.rewards.scored_after_unit`): the unit is released and scored
        by a side call on the rollout worker that generated it (a TAG rank's unit: on a rollout worker,
        its pixels sent along), in the worker's ``score`` group, beside its next unit."""
        decoded = result.pop("decoded", None)
        scorer = result.pop("score_on", None) or self.scorers[len(self.score_row) % len(self.scorers)]
        call = self.actors[scorer].score.options(concurrency_group=SCORE_GROUP)
        self.unscored[unit.uid] = result
        self.score_row[unit.uid] = scorer
        self.in_flight[call.remote(unit.uid, decoded)] = (REWARD_ROW, unit)

    def scored(self, unit: RolloutUnit, scored, inline: bool = False) -> None:
        """The :class:`~digenrl.rewards.base.Scores` of a rolled-out unit, whatever scored it (the worker
        inline, the reward actor, a rollout worker after the unit): its scoring span on the reward row
        (on the scoring worker's row), its latency, then the unit's advantages and metrics."""
        row = self.score_row.pop(unit.uid, REWARD_ROW)
        queued = {} if inline else {"wait_s": scored.wait_s, "queue_depth": scored.queue_depth}
        span = (scored.start - self.t0, scored.end - self.t0)
        apart = {} if inline else {"samples": len(scored.total), **queued}  # scored apart from the unit
        self.timeline.record(
            row, "reward", unit.uid, unit.iteration, unit.version, *span, service=row == REWARD_ROW, **apart
        )
        summary = self.unscored.pop(unit.uid)
        summary["rewards"], summary["reward_parts"] = scored.total, scored.parts
        summary["reward_calls"] = [
            {"seconds": scored.end - scored.start, "timings": scored.timings, **queued}
        ]
        self.ledger.rolled_out(unit, summary)

    def completed(self, unit: Unit, stepped: int | None) -> None:
        self.ledger.finished(unit.uid)
        if stepped is not None:
            self.ledger.wait_for(
                stepped, {u.uid for _, u in self.in_flight.values()} | self.after_step(stepped)
            )
            oldest = (
                self.sched.published_version - self.sched.cfg.max_staleness
            )  # no unit needs older weights
            self.sync.prune(oldest)
