"""The Ray runtime: the scheduler's decisions executed by Ray actors (DESIGN.md §4).

    ask the scheduler for work for every idle worker -> submit it to that worker's actor
    -> wait for the first unit to finish -> record it (timeline, rewards, gradients, weights)
    -> tell the scheduler -> repeat until the last optimizer step is done

All policy lives in :class:`~digenrl.engine.scheduler.Scheduler` (the planner's simulator
drives the same class in virtual time); this module only moves data: rollout samples and
published weights go through the Ray object store, the driver keeps only rewards, stats and
references. Advantages are computed here because only the driver sees every reward: per
prompt as soon as a rollout unit arrives, with global std once the whole iteration is in
(the scheduler then holds training back: ``wait_for_full_batch``).

Placement and Ray plumbing live in :mod:`digenrl.engine.cluster`. With ``reward.service`` one reward actor, outside the placement group,
scores for every worker that rolls out: a rollout unit's result carries the ref of its scores,
the scheduler ``release``s the worker (it takes its next unit at once) and the driver waits on
that ref like on any unit; the unit is ``complete`` (advantages, train units) when the scores
arrive. The actor's scoring spans are the timeline's ``reward`` row.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from digenrl.checkpoint import find_checkpoint, latest_checkpoint, read_state, save_checkpoint_files
from digenrl.config import PoolConfig, RunConfig
from digenrl.engine.cluster import (REWARD_ROW, actor_died, fault_plan, first_line, head_problem, num_restarts,
                                    ray_workers)
from digenrl.engine.scheduler import RolloutUnit, Scheduler, SchedulerConfig, StepUnit, TrainUnit, Unit, WorkerSpec
from digenrl.engine.timeline import SERVICE_POOL, Timeline
from digenrl.errors import RunStopped, UserError
from digenrl.lora import WeightSyncError
from digenrl.progress import progress
from digenrl.prompts import load_prompts
from digenrl.rewards import build_reward
from digenrl.rewards.service import reward_call_metrics
from digenrl.runlog import RunDir, check_writable, default_run_dir
from digenrl.trainer import RunResult, iteration_metrics, resume_history, save_iteration_samples
from digenrl.units import assign_advantages, merge_stats

RESTART_POLL_S = 0.5  # how often to ask a restarting worker whether it is back
HEAD_PROBE_S = 2.0  # how often the driver checks that the cluster's head still answers


# ------------------------------------------------------------------------------ the run


def run_engine(cfg: RunConfig, run_dir: Path | None = None, on_iteration: Callable[[dict], None] | None = None,
               ray_address: str | None = None, resume: Path | None = None) -> RunResult:
    """Train ``cfg`` on Ray with placement ``cfg.placement.mode`` (colocated | disaggregated).

    Writes the same run directory as :meth:`LocalTrainer.run` plus ``timeline.json`` and
    ``timeline.png``. ``ray_address`` joins an existing cluster; without it a local one is
    started (or the one this process is already connected to is used). Ray is shut down, and
    every actor killed, on return and on any exception.

    ``resume`` (a run or checkpoint directory) starts every worker from the latest complete
    checkpoint -- weights, version, optimizer and RNG states -- with an empty pipeline: a rollout
    of a later iteration that was generated (async mode) but not trained before the stop is
    generated again with the checkpoint's weights, so no sample is trained twice. A resumed run
    appends to the checkpoint's run directory unless ``run_dir`` forks it elsewhere.
    """
    if cfg.placement.mode == "local":
        raise UserError("placement.mode: 'local' runs without the engine (use LocalTrainer)")
    resumed = read_state(find_checkpoint(resume)) if resume is not None else None
    start = resumed.iteration if resumed is not None else 0
    if start > cfg.train.iterations:
        raise UserError(f"--resume: the checkpoint has {start} iterations done, more than train.iterations "
                        f"({cfg.train.iterations})")
    plan = worker_plan(cfg)
    scheduler = Scheduler(scheduler_config(cfg, start), [spec for spec, _ in plan])
    preflight(cfg, resumed)
    run_dir, history = resume_history(resumed, run_dir)
    check_writable(run_dir or cfg.output.run_dir or default_run_dir(cfg), "output.run_dir")
    if resumed is not None and start == cfg.train.iterations:  # finished already: nothing to do
        return RunResult(Path(run_dir), history)
    files = {f.name: f.read_bytes() for f in resumed.path.iterdir() if f.is_file()} if resumed else None
    started = time.time()  # the timeline starts here: Ray and the workers starting up are its first events
    with _user_errors(), ray_workers(cfg, plan, ray_address, files) as actors:
        out = RunDir(cfg, run_dir, history=history)
        engine = Engine(cfg, scheduler, plan, actors, out, on_iteration, history)
        engine.t0 = started
        try:
            rows = engine.run()
            engine.save_final()
        finally:
            progress("stopping workers...")  # the `with` releases them next (Ray shutdown: seconds)
            engine.save_timeline()
            out.close()
    return RunResult(out.path, rows)


def preflight(cfg: RunConfig, resumed=None) -> None:
    """Validate here, in seconds and before Ray starts, what every worker will build: prompts, the
    reward (dry-run on a decoded sample) and -- for a random-init preset, which is cheap to build
    -- the model, its LoRA targets and the fit of a checkpoint to resume. A pretrained model is
    only built by the workers (its errors reach the caller from there, as the same one line)."""
    prompts = load_prompts(cfg.prompts)
    # with reward.service only the reward actor loads the reward models (and checks them, before training)
    reward = build_reward(cfg.reward) if cfg.reward.service is None else None
    if cfg.model.pretrained is None:
        from digenrl.checkpoint import load_checkpoint
        from digenrl.policy import Policy
        from digenrl.units import preflight_reward

        policy = Policy(cfg, device="cpu", trainable=resumed is not None)
        if reward is not None:
            preflight_reward(reward, policy.adapter, prompts)
        if resumed is not None:  # fits this model, every file reads back (weights verified)
            load_checkpoint(resumed.path, policy, rng=False)


def worker_plan(cfg: RunConfig) -> list[tuple[WorkerSpec, PoolConfig]]:
    """One worker per device. Colocated: every device of every pool does both jobs (the same
    hardware a disaggregated run of those pools gets). Disaggregated: the rollout pool's
    devices roll out, the trainer pool's are the trainer ranks. Rollout workers come first:
    they ask for work first, so with TAG a trainer takes only the rollout units left over."""
    pools = {p.name: p for p in cfg.cluster.pools}
    if cfg.placement.mode == "colocated":
        plan = [(WorkerSpec(f"{p.name}{i}", "both"), p) for p in cfg.cluster.pools for i in range(p.count)]
    else:
        rollout, trainer = pools[cfg.placement.rollout_pool], pools[cfg.placement.trainer_pool]
        if rollout is trainer:
            raise UserError("placement: disaggregated needs placement.rollout_pool and placement.trainer_pool "
                            f"to be different pools (both are '{rollout.name}')")
        plan = [(WorkerSpec(f"{rollout.name}{i}", "rollout"), rollout) for i in range(rollout.count)]
        plan += [(WorkerSpec(f"{trainer.name}{i}", "trainer"), trainer) for i in range(trainer.count)]
    if cfg.train.device == "cuda" and any(p.device.lower() == "cpu" for _, p in plan):
        raise UserError("train.device: cuda, but cluster.pools devices are 'cpu' (logical CPU pools); "
                        "set the pools' device to 'gpu' or a GPU type such as H100")
    return plan


def scheduler_config(cfg: RunConfig, start_iteration: int = 0) -> SchedulerConfig:
    e = cfg.engine
    try:
        return SchedulerConfig(
            placement=cfg.placement.mode,
            groups_per_iteration=cfg.train.prompts_per_iteration,
            unit_groups=e.unit_groups,
            tsp_degree=e.tsp_degree,
            tag=e.tag,
            gap=e.gap,
            max_staleness=e.max_staleness,
            iterations=cfg.train.iterations,
            wait_for_full_batch=cfg.algorithm.std == "global",  # global std needs every reward
            start_iteration=start_iteration,
        )
    except ValueError as exc:
        raise UserError(f"engine: {exc}") from None


@contextlib.contextmanager
def _user_errors():
    """A UserError / WeightSyncError raised inside an actor reaches the caller as itself."""
    import ray

    try:
        yield
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, (UserError, WeightSyncError)):
            raise cause from None
        raise


# ------------------------------------------------------------------------- the driver loop


@dataclass
class RewardBatch:
    """What the driver keeps of a rollout unit: rewards (advantages, metrics) and the preview
    pixels (sample grids), not its samples. Quacks like ``Samples`` for those uses."""

    rewards: torch.Tensor
    reward_parts: dict[str, torch.Tensor]
    prompts: list[str]
    group_ids: list[int]
    preview: torch.Tensor | None = None
    advantages: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rewards)


class Engine:
    """Drives the scheduler with Ray actors; records the timeline and the metrics."""

    def __init__(self, cfg: RunConfig, scheduler: Scheduler, plan, actors: dict, out: RunDir,
                 on_iteration: Callable[[dict], None] | None, history: list[dict] | None = None):
        self.cfg, self.sched, self.actors, self.out, self.on_iteration = cfg, scheduler, actors, out, on_iteration
        self.order = [spec.name for spec, _ in plan]  # idle workers ask in this order
        self.role = {spec.name: spec.role for spec, _ in plan}
        self.rank0 = next(spec.name for spec, _ in plan if spec.role != "rollout")
        self.timeline = Timeline()
        for spec, pool in plan:
            self.timeline.add_worker(spec.name, pool.name)
        if cfg.reward.service is not None:
            self.timeline.add_worker(REWARD_ROW, SERVICE_POOL)
        self.t0 = time.time()

        self.in_flight: dict = {}  # ObjectRef to wait on -> (worker, unit)
        self.samples: dict[str, object] = {}  # rollout uid -> ObjectRef of its Samples
        self.batches: dict[str, RewardBatch] = {}  # rollout uid -> rewards / advantages
        self.unscored: dict[str, dict] = {}  # released rollout uid -> its summary, until the scores arrive
        self.reward_calls: dict[int, list[dict]] = defaultdict(list)  # iteration -> reward calls (latency)
        self.unit_uids: dict[int, dict[int, str]] = defaultdict(dict)  # iteration -> index -> rollout uid
        self.trained: Counter[str] = Counter()  # rollout uid -> TSP shares trained
        self.total_terms: dict[int, int] = {}  # iteration -> (sample, trained step) terms
        self.stats: dict[int, list[dict]] = defaultdict(list)
        self.grad_norm: dict[int, float] = {}
        self.staleness: dict[int, int] = defaultdict(int)
        self.packets: dict = {}  # version -> WeightPacket published by rank 0
        self.rank_checksums: dict[int, set[str]] = defaultdict(set)
        self.waiting: dict[int, set[str]] = {}  # finished iteration -> units still running from its span
        self.side: dict = {}  # ObjectRef of a rank-0 call (checkpoint, eval) -> (what, iteration)
        self.evals: dict[int, dict] = {}  # iteration -> eval/<reward> metrics
        self.checkpoints: dict[int, dict[str, bytes]] = {}  # iteration -> files, written after its row
        self.rows: list[dict] = list(history or [])
        self.restarts: Counter[str] = Counter()  # worker -> times it died and was restarted
        self.faults = fault_plan(cfg)  # (worker, unit uid) to kill, each once
        self.start_checksum: str | None = None  # weights every (re)started worker must hold
        self.idle: set[str] = set()
        self.restarting: dict[str, float] = {}  # worker -> when to ask it for ready() again
        self.last_probe = 0.0

    def inject(self, worker: str, unit: Unit) -> bool:
        """Fault injection: True (once) when ``worker`` is to die in ``unit``."""
        if (worker, unit.uid) in self.faults:
            self.faults.discard((worker, unit.uid))
            return True
        return False

    def run(self) -> list[dict]:
        import ray

        for w in self.order:  # start-up: from the run's start until every worker was ready
            self.timeline.record(w, "start", f"start-{w}", 0, 0, 0.0, time.time() - self.t0)
        idle = self.idle = set(self.order)
        self.last_probe = time.time()
        rank0 = self.actors[self.rank0]
        self.start_checksum = ray.get(rank0.ready.remote())["checksum"]
        if any(role == "rollout" for role in self.role.values()):  # for a re-queued unit of this version
            self.packets[self.sched.published_version] = ray.get(rank0.publish.remote())
        while not self.sched.done():
            for worker in [w for w in self.order if w in idle]:
                unit = self.sched.next_unit(worker)
                if unit is not None:
                    idle.discard(worker)
                    self.submit(worker, unit)
            self.poll_restarts()
            if not self.in_flight and not self.side and not self.restarting:
                raise RuntimeError(f"engine stalled: nothing in flight at version {self.sched.published_version}")
            ready, _ = ray.wait([*self.in_flight, *self.side], num_returns=1,
                                timeout=RESTART_POLL_S if self.restarting else HEAD_PROBE_S)
            self.check_head()
            if not ready:
                continue
            ref = ready[0]
            if ref in self.side:
                self.side_done(ref)
                continue
            worker, unit = self.in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.ObjectLostError) as exc:
                if not actor_died(exc):
                    raise
                self.worker_died(worker, unit, exc)  # re-queues its unit, or stops the run
                continue
            if worker == REWARD_ROW:  # the scores of a released rollout unit: now it is complete
                self.scored(unit, result)
            else:
                idle.add(worker)
                pending = self.absorb(worker, unit, result)
                if pending is not None:  # scored by the reward service: the worker is free, the unit not done
                    self.sched.release(unit)
                    self.in_flight[pending] = (REWARD_ROW, unit)
                    continue
            before = self.sched.published_version
            self.sched.complete(unit, result)
            self.iteration_bookkeeping(unit, finished=before if self.sched.published_version > before else None)
        while self.side:  # the last checkpoint / eval
            (ref,), _ = ray.wait(list(self.side), num_returns=1)
            self.side_done(ref)
        return self.rows

    # -- rank-0 side calls: checkpoint and eval after a step ----------------------------

    def after_step(self, k: int) -> list[str]:
        """Ask rank 0 for iteration k's checkpoint / eval now: it has just stepped to version k+1
        and gets no other work before these calls run (an actor runs its calls in order). Returns
        the names the metrics row of k waits for."""
        done, out_cfg, rank0 = k + 1, self.cfg.output, self.actors[self.rank0]
        names = []
        if out_cfg.eval_every and done % out_cfg.eval_every == 0:
            self.side[rank0.evaluate.remote()] = ("eval", k)
            names.append(f"eval-{k}")
        if (out_cfg.checkpoint_every and done % out_cfg.checkpoint_every == 0) or done == self.cfg.train.iterations:
            extra = {"driver": "engine", "placement": self.cfg.placement.mode,
                     "max_staleness": self.cfg.engine.max_staleness}
            self.side[rank0.checkpoint.remote(done, extra)] = ("checkpoint", k)
            names.append(f"checkpoint-{k}")
        return names

    def side_done(self, ref) -> None:
        import ray

        what, k = self.side.pop(ref)
        if what == "restart":
            return self.restarted(k, ref)
        result = ray.get(ref)
        if what == "eval":
            self.evals[k] = result
        else:
            self.checkpoints[k] = result
        self.iteration_bookkeeping(None, finished=None, done_name=f"{what}-{k}")

    # -- faults: a dead rollout worker's unit is re-queued whole; a dead trainer rank stops ----

    def worker_died(self, worker: str, unit: Unit, exc: Exception) -> None:
        """Ray restarts a rollout worker (up to ``engine.max_restarts``); its unit goes back to the
        scheduler whole, with its original version, and is generated again from its first step.
        A trainer rank holds the optimizer state and its share of the gradient: the run stops,
        the last complete checkpoint stays as it is, and the message says how to resume."""
        self.check_head(now_please=True)  # a dead head takes every actor along: that is not a worker fault
        self.samples.pop(getattr(unit, "uid", None), None)
        limit = self.cfg.engine.max_restarts
        if worker == REWARD_ROW:
            import ray

            # A reward actor that dies is restarted by Ray, which runs its lost calls again; a call
            # fails only when the actor is gone for good, or its owner (the rollout worker that
            # submitted it) died: then the scores are lost and the unit is generated again.
            if not isinstance(exc, ray.exceptions.ObjectLostError):
                raise RunStopped(f"the reward actor died and was not restarted (engine.max_restarts: {limit}; "
                                 f"{first_line(exc)}); the run stopped. {self.resume_hint()}")
            print(f"warning: the scores of {unit.uid} were lost with the worker that submitted them; "
                  "generating it again", file=sys.stderr)
            self.sched.requeue(unit)
            return
        if self.role[worker] != "rollout" or not isinstance(unit, RolloutUnit):
            raise RunStopped(f"trainer rank {worker} died while running {unit.uid} ({first_line(exc)}); "
                             f"the run stopped. {self.resume_hint()}")
        self.restarts[worker] += 1
        if self.restarts[worker] > limit:
            raise RunStopped(f"rollout worker {worker} died {self.restarts[worker]} times (engine.max_restarts: "
                             f"{limit}); the run stopped. {self.resume_hint()}")
        print(f"warning: rollout worker {worker} died in {unit.uid}; restarting it "
              f"({self.restarts[worker]} of {limit}) and generating {unit.uid} again", file=sys.stderr)
        self.sched.requeue(unit)
        self.restarting[worker] = time.time() + RESTART_POLL_S  # asked to report ready once rebuilt

    def poll_restarts(self) -> None:
        """Ask each restarting worker for ready(): the answer comes once Ray has rebuilt it (a call
        while it is still restarting fails at once with ActorUnavailableError: ask again later)."""
        now = time.time()
        for worker, at in list(self.restarting.items()):
            if at <= now:
                del self.restarting[worker]
                self.side[self.actors[worker].ready.remote()] = ("restart", worker)

    def restarted(self, worker: str, ref) -> None:
        import ray

        try:
            ready = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:  # still restarting
            self.restarting[worker] = time.time() + RESTART_POLL_S
            return
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise RunStopped(f"{worker} did not come back after a restart ({first_line(exc)}); "
                             f"the run stopped. {self.resume_hint()}") from None
        if ready["checksum"] != self.start_checksum:
            raise WeightSyncError(f"{worker} restarted with other weights than the run started with")
        self.idle.add(worker)

    def check_head(self, now_please: bool = False) -> None:
        """Every HEAD_PROBE_S (or now): does the cluster's head (GCS) still accept connections?
        Ray itself would wait a minute and then end this process without a word."""
        now = time.time()
        if now - self.last_probe < HEAD_PROBE_S and not now_please:
            return
        self.last_probe = now
        problem = head_problem()
        if problem is not None:
            import ray

            head = ray.get_runtime_context().gcs_address
            raise RunStopped(f"the Ray cluster's head at {head} stopped answering ({problem}); the run stopped. "
                             f"{self.resume_hint()}")

    def resume_hint(self) -> str:
        last = latest_checkpoint(self.out.path)
        if last is None:
            return f"No checkpoint was written yet (output.checkpoint_every: {self.cfg.output.checkpoint_every})."
        return f"Last checkpoint: {last}; resume with: digenrl train --resume {self.out.path}"

    # -- submit: one Ray call per unit ---------------------------------------------------

    def submit(self, worker: str, unit: Unit) -> None:
        actor = self.actors[worker]
        if isinstance(unit, RolloutUnit):
            # rollout workers swap to the unit's version first (trainer ranks already hold it)
            packet = self.packets.get(unit.version) if self.role[worker] == "rollout" else None
            samples, ref = actor.rollout.options(num_returns=2).remote(unit, packet, self.inject(worker, unit),
                                                                       self.inject(REWARD_ROW, unit))
            self.samples[unit.uid] = samples
        elif isinstance(unit, TrainUnit):
            batch = self.batches[unit.rollout_uid]
            assert batch.advantages is not None, "train unit handed out before its advantages exist"
            ref = actor.train.remote(unit, self.samples[unit.rollout_uid], batch.advantages,
                                     self.total_terms[unit.iteration], self.inject(worker, unit))
        else:
            ref = actor.step.remote(unit, worker == self.rank0 and "rollout" in self.role.values())
        self.in_flight[ref] = (worker, unit)

    # -- absorb: what a finished unit leaves behind --------------------------------------

    def absorb(self, worker: str, unit: Unit, result: dict):
        """Returns the ref of the unit's scores when the reward service still computes them."""
        for ev in result["events"]:
            self.timeline.record(worker, ev["kind"], ev["uid"], ev["iteration"], ev["version"],
                                 ev["start"] - self.t0, ev["end"] - self.t0, ev.get("sample_versions", ()),
                                 **ev["args"])
        k = unit.iteration
        if isinstance(unit, RolloutUnit):
            if "reward_ref" in result:
                self.unscored[unit.uid] = result
                return result["reward_ref"]
            self.reward_calls[k] += result["reward_calls"]
            self.rolled_out(unit, result)
        elif isinstance(unit, TrainUnit):
            self.stats[k].append(result["stats"])
            self.staleness[k] = max(self.staleness[k], k - unit.sample_version)
            self.trained[unit.rollout_uid] += 1
            if self.trained[unit.rollout_uid] == unit.tsp_degree:  # every TSP share done: free it
                del self.samples[unit.rollout_uid]
        elif isinstance(unit, StepUnit):
            if worker == self.rank0:
                self.grad_norm[k] = result["grad_norm"]
                if result["packet"] is not None:
                    self.packets[unit.version] = result["packet"]
            if result["checksum"] is not None:
                self.rank_checksums[unit.version].add(result["checksum"])
                if len(self.rank_checksums[unit.version]) > 1:
                    raise WeightSyncError(f"trainer ranks hold different weights after step {k}")
        return None

    def scored(self, unit: RolloutUnit, scored) -> None:
        """The reward actor's :class:`~digenrl.rewards.service.Scored` for a released unit: its
        scoring span on the reward row, its latency, then the unit as if scored inline."""
        self.timeline.record(REWARD_ROW, "reward", unit.uid, unit.iteration, unit.version, scored.start - self.t0,
                             scored.end - self.t0, service=True, samples=len(scored.total),
                             wait_s=scored.wait_s, queue_depth=scored.queue_depth)
        self.reward_calls[unit.iteration].append({"seconds": scored.end - scored.start, "timings": scored.timings,
                                                  "wait_s": scored.wait_s, "queue_depth": scored.queue_depth})
        summary = self.unscored.pop(unit.uid)
        summary["rewards"], summary["reward_parts"] = scored.total, scored.parts
        self.rolled_out(unit, summary)

    def rolled_out(self, unit: RolloutUnit, summary: dict) -> None:
        k, per_iteration = unit.iteration, self.sched.cfg.units_per_iteration
        batch = self.batches[unit.uid] = RewardBatch(summary["rewards"], summary["reward_parts"], summary["prompts"],
                                                     summary["group_ids"], summary["preview"])
        self.unit_uids[k][unit.index] = unit.uid
        terms = summary["terms"] * per_iteration  # every unit of an iteration has the same size
        if self.total_terms.setdefault(k, terms) != terms:
            raise RuntimeError(f"{unit.uid}: units of iteration {k} differ in size")
        if self.cfg.algorithm.std == "global":
            mine = self.iteration_batches(k)
            if len(mine) == per_iteration:  # the scheduler holds training back until now
                assign_advantages(mine, self.cfg)
        else:
            assign_advantages([batch], self.cfg)

    def iteration_batches(self, k: int) -> list[RewardBatch]:
        """The iteration's rolled-out batches in group order (as the LocalTrainer sees them)."""
        uids = self.unit_uids[k]
        return [self.batches[uids[j]] for j in sorted(uids)]

    # -- metrics rows --------------------------------------------------------------------

    def iteration_bookkeeping(self, unit: Unit | None, finished: int | None, done_name: str | None = None) -> None:
        """Write iteration k's metrics once its step is done and every unit that was running
        during its span has finished too (so the bubble counts their busy time), and its eval;
        then its checkpoint (so a checkpoint never runs ahead of the metrics it resumes after)."""
        for running in self.waiting.values():
            running.discard(unit.uid if unit is not None else done_name)
        if finished is not None:
            self.waiting[finished] = {u.uid for _, u in self.in_flight.values()} | set(self.after_step(finished))
            oldest = self.sched.published_version - self.sched.cfg.max_staleness
            self.packets = {v: p for v, p in self.packets.items() if v >= oldest}
        while self.waiting and not self.waiting[min(self.waiting)]:
            k = min(self.waiting)
            del self.waiting[k]
            row = self.metrics_row(k)
            self.rows.append(row)
            self.out.log(row)
            if self.on_iteration:
                self.on_iteration(row)
            if k in self.checkpoints:
                save_checkpoint_files(self.out.path, k + 1, self.checkpoints.pop(k), self.cfg.output.keep_last)

    def metrics_row(self, k: int) -> dict:
        (span,) = self.timeline.iteration_stats(only=k)
        stats = merge_stats(self.stats.pop(k))
        stats["grad_norm"] = self.grad_norm.pop(k)
        batches = self.iteration_batches(k)
        row = iteration_metrics(k, k + 1, batches, stats, span["wall_s"], rollout_s=span["rollout_device_s"],
                                train_s=span["train_device_s"], sync_s=span["sync_s"],
                                sync_bytes=span["sync_bytes"], sample_staleness=self.staleness.pop(k, 0))
        row["samples_per_s"] = span["samples_per_s"]
        row["bubble_fraction"] = span["bubble_fraction"]
        row.update(reward_call_metrics(self.reward_calls.pop(k, [])))
        row.update(self.evals.pop(k, {}))
        row["worker_restarts"] = sum(self.restarts.values()) + num_restarts(self.actors.get(REWARD_ROW))
        every = self.cfg.output.save_samples_every
        if (every and k % every == 0) or k == self.cfg.train.iterations - 1:  # as LocalTrainer does
            save_iteration_samples(self.out.path, k, batches)
        for uid in self.unit_uids.pop(k).values():
            del self.batches[uid]
        return row

    # -- outputs -------------------------------------------------------------------------

    def save_final(self) -> None:
        """``final/`` from trainer rank 0's weights, written exactly as LocalTrainer writes it."""
        import ray

        files = ray.get(self.actors[self.rank0].export_final.remote())
        final = self.out.path / "final"
        final.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (final / name).write_bytes(data)

    def save_timeline(self) -> None:
        if self.timeline.events:
            self.timeline.save_json(self.out.path / "timeline.json")
            self.timeline.to_png(self.out.path / "timeline.png")
