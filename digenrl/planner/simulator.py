"""The engine's scheduler in virtual time, run by the engine's own driver loop (docs/architecture.md).

Details: docs/modules.md, `digenrl.planner.simulator`.
"""

from __future__ import annotations

import math
import random

from digenrl.engine.timeline import Timeline
from digenrl.placement.plan import Plan
from digenrl.planner.bound import bound, setups, unit_train_time
from digenrl.planner.costmodel import CostModel
from digenrl.planner.memory import DeviceSetup
from digenrl.planner.sim_bts import bts_event, elastic
from digenrl.planner.sim_jobs import Job, Seg
from digenrl.planner.sim_result import SimResult, pool_summaries, steady_summary
from digenrl.schedule.driver import Done, drive
from digenrl.schedule.scheduler import Scheduler
from digenrl.units.types import RolloutUnit, TrainUnit

EPS = 1e-12


# ------------------------------------------------------------------------------- simulation


class Simulator:
    """One simulated run of ``plan`` for ``iterations`` iterations."""

    def __init__(
        self,
        plan: Plan,
        cost: CostModel,
        iterations: int = 3,
        wait_for_full_batch: bool = False,
        seed: int | None = None,
    ):
        plan = plan.typed()
        self.plan, self.cost, self.iterations = plan, cost, iterations
        self.rng = random.Random(seed) if seed is not None else None  # None: every unit takes its mean
        self.workload = cost.workload
        self.setups = setups(plan, cost)
        workers = plan.leads()  # with sequence parallelism, one worker per group of sp devices
        self.pool = {w.name: w.pool for w in workers}
        self.role = {w.name: w.role for w in workers}
        self.order = [w.name for w in workers]
        self.ranks = [w.name for w in workers if w.role != "rollout"]
        self.rank0 = self.ranks[0]
        self.publish = any(w.role == "rollout" for w in workers)
        w, full = self.workload, wait_for_full_batch
        sched_cfg = plan.scheduler_config(w.prompts, iterations, full, optimizer_steps=w.optimizer_steps)
        self.sched = Scheduler(sched_cfg, workers, elastic=elastic(self, sched_cfg))  # tag auto: BTS
        self.shared = cost.cluster.is_cpu  # logical CPU devices share the host's cores
        self.timeline = Timeline()
        for w in workers:
            self.timeline.add_worker(w.name, w.pool.name)
        self.now, self.seq = 0.0, 0
        self.running: list[Job] = []
        self.held = {n: 0 for n in self.order}  # weights version each rollout worker holds
        # what a trainer's device is set up for (colocated devices start sampling, TAG ranks training)
        self.phase = {n: "train" if self.role[n] == "trainer" else "rollout" for n in self.order}
        self.rolled: dict[str, float] = {}  # rollout uid -> when it ended (its samples leave then)
        self.last_rolled: dict[int, float] = {}  # iteration -> when its last rollout unit ended
        # rollout uid -> when its scores are in (after it: a hidden reward)
        self.scored: dict[str, float] = {}
        self._cache: dict = {}

    # -- durations (cached) --------------------------------------------------------------

    def _d(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def _segments(self, worker: str, unit, now: float) -> list[Seg]:
        pool, cost, ov = self.pool[worker], self.cost, self.cost.overheads
        dev, setup = pool.device, self.setups[pool.name]
        segs = [Seg("call", ov.call_s, False)]
        base = {"uid": unit.uid, "iteration": unit.iteration}
        if isinstance(unit, RolloutUnit):
            if self.role[worker] == "rollout" and unit.version != self.held[worker]:
                segs.append(
                    Seg(
                        "sync",
                        self._d(("fetch", dev), lambda: cost.sync_fetch(dev)),
                        True,
                        dict(
                            base,
                            kind="sync",
                            uid=f"sync-{unit.version}-fetch",
                            version=unit.version,
                            args={
                                "direction": "fetch",
                                "bytes": self.workload.sync_bytes,
                                "transport": self.workload.weight_sync,
                            },
                        ),
                    )
                )
                self.held[worker] = unit.version
            segs += self._switch(worker, "rollout", dev, setup)
            size = len(unit.groups) / unit.parts  # groups in the unit (a fraction for a part of one)
            total, reward = self._d(("rollout", pool.name, size), lambda: cost.rollout_unit(dev, size, setup))
            hidden = 0.0  # a rollout-only worker scores a model reward beside its next unit
            if self.role[worker] == "rollout":
                hidden = self._d(("hidden", pool.name, size), lambda: cost.reward_hidden(dev, size, setup))
            segs.append(
                Seg(
                    "rollout",
                    self._draw(total - hidden, dev, "rollout"),
                    True,
                    dict(
                        base,
                        kind="rollout",
                        version=unit.version,
                        reward_s=reward,
                        hidden_s=hidden,
                        args={
                            "samples": len(unit.groups) * self.workload.group_size // unit.parts,
                            "groups": list(unit.groups),
                        },
                    ),
                )
            )
        elif isinstance(unit, TrainUnit):
            parts = self.sched.cfg.group_parts
            transfer = self._d(
                ("transfer", len(unit.groups), parts), lambda: cost.transfer(len(unit.groups) / parts)
            )
            # with a barrier every train unit of k leaves with k's last rollout (advantages over the batch)
            ended = (
                self.last_rolled.get(unit.iteration, now)
                if self.sched.cfg.barrier
                else self.rolled.get(unit.rollout_uid, now)
            )
            arrive = ended + transfer  # the samples at the trainer
            segs.insert(0, Seg("samples", max(0.0, arrive - now), False))  # then the call
            segs += self._switch(worker, "train", dev, setup)
            d = self._d(
                ("train", dev, len(unit.groups), parts, unit.tsp_rank, unit.tsp_degree),
                lambda: unit_train_time(
                    cost, dev, len(unit.groups), parts, unit.tsp_rank, unit.tsp_degree, setup
                ),
            )
            segs.append(
                Seg(
                    "train",
                    self._draw(d, dev, "train"),
                    True,
                    dict(
                        base,
                        kind="train",
                        version=unit.version,
                        sample_versions=(unit.sample_version,),
                        args={
                            "groups": list(unit.groups),
                            "tsp_rank": unit.tsp_rank,
                            "tsp_degree": unit.tsp_degree,
                            "minibatch": unit.step,
                        },
                    ),
                )
            )
        else:
            publish = self.publish and worker == self.rank0 and unit.last  # once per iteration
            segs += self._switch(worker, "train", dev, setup)
            d, pub = self._d(("step", dev, publish), lambda: cost.step(dev, len(self.ranks), publish, setup))
            segs.append(Seg("wait", math.inf, False))
            segs.append(
                Seg(
                    "step",
                    d,
                    True,
                    dict(
                        base,
                        kind="step",
                        version=unit.iteration,
                        publish_s=pub,
                        args={"publishes": unit.version} if unit.last else {},
                    ),
                )
            )
        return segs

    def _draw(self, mean: float, dev: str, kind: str) -> float:
        """One unit's duration: the mean, or a lognormal draw of that mean and the unit-time spread."""
        cv = self.cost.unit_cv(dev, kind) if self.rng is not None else 0.0
        if cv <= 0:
            return mean
        s2 = math.log1p(cv * cv)  # lognormal with mean 1 and std cv
        return mean * self.rng.lognormvariate(-s2 / 2, math.sqrt(s2))

    def _switch(self, worker: str, phase: str, dev: str, setup: DeviceSetup) -> list[Seg]:
        """A phase change of a device that trains: colocated, and a TAG rank's Actor -> helper ->
        Actor (the RFC, verl-omni#321: "both switches are included in scheduling cost"), the same
        code path on the same module, so the same price (``CostModel.switch``)."""
        if self.role[worker] == "rollout" or self.phase[worker] == phase:
            return []
        self.phase[worker] = phase
        s = self._d(("switch", dev), lambda: self.cost.switch(dev, setup))
        return [Seg("switch", s, False)] if s > 0 else []

    # -- the driver loop's backend: virtual time ------------------------------------------

    def run(self) -> Timeline:
        drive(self.sched, self.order, self)
        return self.timeline

    def start(self, worker: str, unit) -> None:
        job = Job(self.seq, worker, unit, self._segments(worker, unit, self.now))
        self.seq += 1
        self._enter(job, self.now)
        self.running.append(job)

    def next_event(self) -> Done:
        """Advance virtual time to the next completion; simultaneous ones are reported in submission
        order, one at a time, as ``ray.wait(num_returns=1)`` does."""
        running = self.running
        self._release_collective(running, self.now)
        if not running:
            raise RuntimeError(
                f"simulation stalled at t={self.now:.3f}s, version {self.sched.published_version}"
            )
        while True:
            rates = self._rates(running)
            dt = min(
                (j.remaining / rates[j.seq] for j in running if j.remaining < math.inf), default=math.inf
            )
            if dt == math.inf:
                raise RuntimeError(f"simulation deadlock at t={self.now:.3f}s (every rank waits in the step)")
            self.now += dt
            now = self.now
            for j in running:
                if j.remaining < math.inf:
                    j.remaining -= dt * rates[j.seq]
            # move jobs through finished inner segments (zero-time ones too)
            changed = True
            while changed:
                changed = False
                for j in running:
                    while j.remaining <= EPS and j.i < len(j.segs) - 1:
                        self._leave(j, now)
                        j.i += 1
                        self._enter(j, now)
                        changed = True
                if self._release_collective(running, now):
                    changed = True
            done = [j for j in running if j.remaining <= EPS and j.i == len(j.segs) - 1]
            if done:
                break
        job = min(done, key=lambda j: j.seq)
        self._leave(job, now)
        running.remove(job)
        if isinstance(job.unit, RolloutUnit):
            ready = self.scored.pop(job.unit.uid, now)
            self.rolled[job.unit.uid] = ready
            self.last_rolled[job.unit.iteration] = max(ready, self.last_rolled.get(job.unit.iteration, ready))
        return Done(job.worker, job.unit)

    def completed(self, unit, stepped: int | None) -> None:
        """(Nothing to record: the timeline events were written as the segments ended.)"""

    def _enter(self, job: Job, now: float) -> None:
        seg = job.seg
        seg.start = now
        job.remaining = seg.amount
        if seg.kind == "wait":
            job.arrived = now

    def _release_collective(self, running: list[Job], now: float) -> bool:
        waiting = [j for j in running if j.seg.kind == "wait"]
        if len(waiting) < len(self.ranks):
            return False
        for j in waiting:  # the last rank arrived: the all-reduce runs
            j.remaining = 0.0
            j.seg.amount = 0.0
        return True

    def _rates(self, running: list[Job]) -> dict[int, float]:
        if not self.shared:
            return {j.seq: 1.0 for j in running}
        busy = sum(1 for j in running if j.seg.cpu and j.remaining < math.inf)
        share = self.cost.cpu_rate(busy)
        driver = self.cost.cpu_rate(busy + 1)  # a "call" is the driver's work: it competes with the workers
        return {j.seq: (share if j.seg.cpu else driver if j.seg.kind == "call" else 1.0) for j in running}

    def _leave(self, job: Job, now: float) -> None:
        seg = job.seg
        if seg.event is None:
            return
        ev = dict(seg.event)
        start = job.arrived if ev["kind"] == "step" else seg.start
        reward_s, publish_s = ev.pop("reward_s", 0.0), ev.pop("publish_s", 0.0)
        hidden_s = ev.pop("hidden_s", 0.0)
        if self.sched.elastic is not None:  # tag auto: the decisions' predictions, their errors
            ev["args"] = {**ev.get("args", {}), **self.sched.elastic.event_args(**bts_event(ev, now))}
        self.timeline.record(
            job.worker,
            ev["kind"],
            ev["uid"],
            ev["iteration"],
            ev["version"],
            start,
            now,
            ev.get("sample_versions", ()),
            **ev.get("args", {}),
        )
        if ev["kind"] == "rollout":
            self.scored[ev["uid"]] = now + hidden_s  # its scores: the hidden part after the unit
        if ev["kind"] == "rollout" and reward_s > 0:
            self.timeline.record(
                job.worker,
                "reward",
                ev["uid"],
                ev["iteration"],
                ev["version"],
                max(seg.start, now - (reward_s - hidden_s)),
                now + hidden_s,
            )
        if ev["kind"] == "step" and publish_s > 0:
            v = ev["args"]["publishes"]
            sent = max(seg.start, now - publish_s)
            self.timeline.record(
                job.worker,
                "sync",
                f"sync-{v}-publish",
                v - 1,
                v,
                sent,
                now,
                direction="publish",
                bytes=self.workload.sync_bytes,
                transport=self.workload.weight_sync,
            )
            if self.cost.broadcasts():  # the receivers' threads take it in while they generate
                for worker in (w for w in self.order if self.role[w] == "rollout"):
                    self.timeline.record(
                        worker,
                        "sync",
                        f"sync-{v}-prefetch",
                        v - 1,
                        v,
                        sent,
                        now,
                        direction="prefetch",
                        bytes=self.workload.sync_bytes,
                        transport="broadcast",
                    )


def simulate(
    plan: Plan,
    cost: CostModel,
    iterations: int = 4,
    skip: int | None = None,
    tail: int | None = None,
    wait_for_full_batch: bool = False,
) -> SimResult:
    """Simulate ``iterations`` iterations and summarise the steady state: the first ``skip`` (default
    1: nothing to overlap with yet) and the last ``tail`` (default 1 from 3 iterations on: with
    one-step async the last span holds no next rollout) are left out. With a unit-time spread
    (:meth:`CostModel.has_spread`) ``cost.params.replicas`` seeded runs are pooled (samples over wall
    time, bubble and per-iteration figures averaged); the timeline kept is the run closest to the
    pooled throughput."""
    plan = plan.typed()
    seeds = list(range(max(1, cost.params.replicas))) if cost.has_spread() else [None]
    runs = []
    for seed in seeds:
        sim = Simulator(plan, cost, iterations, wait_for_full_batch, seed=seed)
        timeline = sim.run()
        runs.append((sim, timeline, steady_summary(timeline, skip, tail)))
    summary = pool_summaries([r[2] for r in runs])
    sim, timeline, _ = min(runs, key=lambda r: abs(r[2]["samples_per_s"] - summary["samples_per_s"]))
    return SimResult(plan, timeline, sim.sched, summary, bound(plan, cost, sim.setups), sim.setups)
