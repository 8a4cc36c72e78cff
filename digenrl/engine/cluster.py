"""The engine's actors: started for a run (:func:`ray_workers`), formed into the layout's process
groups, and what a fault looks like from the driver. The cluster and its resources:
:mod:`digenrl.engine.resources`.

Faults: ``num_restarts`` reads Ray's count (:func:`digenrl.errors.actor_died` tells a dead process
from a bug; what the engine does about a fault is :mod:`digenrl.engine.recovery`).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

from digenrl.config.run import RunConfig
from digenrl.engine.faults import FaultInjector, forget_fired
from digenrl.engine.head_watch import watching_head
from digenrl.engine.resources import (
    connect,
    disconnect,
    head_problem,
    nodes_gone,
    reserve_by_node,
    resource_bundles,
    reward_service_resources,
)
from digenrl.engine.stall import HEALTH_GROUP
from digenrl.engine.worker_setup import ResumeFrom, rollout_checkpoint_files
from digenrl.errors import RunStopped, UserError, WeightSyncError, first_line
from digenrl.placement.layout import RunLayout
from digenrl.placement.plan import Worker
from digenrl.progress import progress
from digenrl.run.rundir import terminal_stderr

REWARD_ROW = "reward"  # the reward actor's timeline row (pool SERVICE_POOL), and its in-flight entries


def num_restarts(actor) -> int:
    """How often Ray has restarted ``actor`` (from the GCS actor table; 0 when unknown). The reward
    actor's restarts are Ray's alone: it reruns the lost calls, the engine never sees them."""
    if actor is None:
        return 0
    try:
        from ray._private import state

        return int(state.actors(actor._actor_id.hex()).get("NumRestarts", 0))
    except Exception:  # noqa: BLE001  (a private API: a metric is not worth a crash)
        return 0


def device_env(num_gpus: float) -> dict | None:
    """An actor that asks for no GPU sees none (Ray leaves ``CUDA_VISIBLE_DEVICES`` unset then, so
    ``device: auto`` would find every GPU of its node and land on GPU 0 beside the GPU workers)."""
    return None if num_gpus else {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}


# ------------------------------------------------------------------- Ray: cluster and actors


@dataclass
class ActorPlan:
    """One worker actor to start: the ``EngineWorker`` constructor's arguments, its reservation
    (``bundle``), whether it scores beside its units (the ``score`` concurrency group), its restart
    budget (a rollout worker holds nothing that cannot be rebuilt: Ray restarts it and the engine
    re-queues its unit; a trainer rank's death stops the run; a sequence-parallel group is restarted
    whole: ``recovery.GroupRestart``)."""

    name: str
    args: tuple
    kwargs: dict
    bundle: dict
    scoring: bool
    max_restarts: int


class FreshActors:
    """Where a run's actors come from, by default: the run reserved as placement groups (one per set
    of workers that must share a node, one for the rest), one new actor per worker, all killed at the
    end. A process that runs
    the engine many times on a cluster it joined may install another source (:func:`actor_source`)."""

    def start(self, cfg: RunConfig, plans: list[ActorPlan], workers: list[Worker], node_groups=()) -> dict:
        """The actors (by worker name), each building its worker; the caller waits for ``ready``.
        ``node_groups``: sets of workers that must share a node (a shard or SP group: STRICT_PACK)."""
        self.groups, slots = reserve_by_node([p.bundle for p in plans], workers, node_groups)
        return {p.name: new_actor(p, group, i) for p, (group, i) in zip(plans, slots)}

    def finish(self, actors: dict, pids: dict, clean: bool) -> None:
        """The run is over (``clean``: it finished; ``pids``: each actor's process at its start)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in actors.values():
            ray.kill(actor, no_restart=True)
        for group in getattr(self, "groups", []):
            remove_placement_group(group)

    def start_reward(self, cfg: RunConfig, faults: FaultInjector):
        """The run's reward actor (``reward.service``), its models loaded; started before the workers."""
        from digenrl.rewards.service import start_reward_actor

        return start_reward_actor(cfg.reward, max_restarts=cfg.engine.max_restarts, faults=faults)

    def finish_reward(self, actor, clean: bool) -> None:
        import ray

        ray.kill(actor, no_restart=True)


_installed = None  # the actor source of this process's runs on a joined cluster (actor_source)


@contextlib.contextmanager
def actor_source(source):
    """Inside: every run on a cluster this process joined gets its actors from ``source`` (its
    ``start`` / ``finish`` and ``start_reward`` / ``finish_reward`` as :class:`FreshActors`'), not
    fresh ones. The test suite keeps a finished run's actors for the next run this way (its conftest;
    docs/engine.md)."""
    global _installed
    if _installed is not None:
        raise RuntimeError("an actor source is already installed in this process")
    _installed = source
    try:
        yield source
    finally:
        _installed = None


def new_actor(plan: ActorPlan, group, index: int, cls=None, **extra):
    """Start ``plan``'s actor (of class ``cls``, default ``EngineWorker``) in bundle ``index`` of the
    placement ``group``; ``extra``: more constructor keywords."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from digenrl.engine.workers import SCORE_GROUP, EngineWorker

    cls = cls or EngineWorker
    # the driver's pings answer beside any call (engine/stall.py); a model reward scored after each
    # unit: the rollout workers' score() runs beside their next unit
    groups = {HEALTH_GROUP: 1, **({SCORE_GROUP: 1} if plan.scoring else {})}
    remote = ray.remote(concurrency_groups=groups)(cls)
    b = plan.bundle
    return remote.options(
        num_cpus=b.get("CPU", 0),
        num_gpus=b.get("GPU", 0),
        resources={k: v for k, v in b.items() if k not in ("CPU", "GPU")},
        runtime_env=device_env(b.get("GPU", 0)),
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        max_restarts=plan.max_restarts,
        max_task_retries=0,
    ).remote(*plan.args, **plan.kwargs, **extra)


@contextlib.contextmanager
def ray_workers(cfg: RunConfig, layout: RunLayout, ray_address: str | None, resume: Path | None = None):
    """Connect (or start Ray), check and reserve the placement, start one actor per worker of the
    ``layout`` (each gets it) and wait until every one has built its policy (from the ``resume``
    checkpoint directory when given: read by path); on exit kill them and release everything."""
    import ray

    progress(
        "starting the Ray cluster..."
        if ray_address is None
        else f"joining the Ray cluster at {ray_address}..."
    )
    ours = connect(layout.workers, ray_address)
    # a head that dies while the driver waits in a Ray call: the run stops in seconds (head_watch)
    with watching_head(ray.get_runtime_context().gcs_address, terminal_stderr()):
        with _started(cfg, layout, ours, resume) as actors:
            yield actors


@contextlib.contextmanager
def _started(cfg: RunConfig, layout: RunLayout, ours: bool, resume: Path | None):
    """:func:`ray_workers` once connected (``ours``: by it, so it disconnects)."""
    import ray

    from digenrl.rewards import scored_after_unit

    workers = layout.workers
    source = _installed if not ours and _installed is not None else FreshActors()
    actors, reward_actor, pids, clean, workers_on = {}, None, {}, False, {}
    try:
        progress(f"starting {len(workers)} workers (each builds the model)...")
        bundles = resource_bundles(workers, ray.cluster_resources(), reserve=reward_service_resources(cfg))
        if cfg.reward.service is not None:  # one reward actor shared by every worker that scores
            reward_actor = source.start_reward(cfg, FaultInjector.from_config(cfg, REWARD_ROW))
        resume_from = None
        if resume is not None:  # rollout workers' fallback copy: never the optimizer state
            resume_from = ResumeFrom(str(Path(resume).resolve()), ray.put(rollout_checkpoint_files(resume)))
        after, followers = scored_after_unit(cfg), layout.sp_followers
        plans = [
            ActorPlan(
                spec.name,
                (cfg, spec.name, spec.role, None if spec.name in followers else reward_actor, resume_from),
                dict(sp_follower=spec.name in followers, layout=layout),
                bundle,
                after and spec.role == "rollout",
                cfg.engine.max_restarts if spec.role == "rollout" else 0,
            )
            for spec, bundle in zip(workers, bundles)
        ]
        actors = source.start(cfg, plans, workers, layout.node_groups)
        ready = dict(zip(actors, ray.get([a.ready.remote() for a in actors.values()])))
        pids = {name: r["pid"] for name, r in ready.items()}
        if len({r["checksum"] for r in ready.values()}) > 1:
            raise WeightSyncError(f"initial weights differ between workers: {ready}")
        for name, r in ready.items():
            workers_on.setdefault(r["node"], []).append(name)
        form_trainer_group(layout, actors, ready)
        form_sp_groups(layout, actors, ready)
        yield {**actors, REWARD_ROW: reward_actor} if reward_actor is not None else actors
        clean = True
    except RunStopped as exc:  # a lost node takes its workers along: name it (the restart needs it back)
        if head_problem() is None:
            exc.nodes_gone = nodes_gone(workers_on)
        raise
    finally:
        if head_problem() is None:  # with the head gone, every call below would wait a minute for it
            # (and the cluster took its processes along)
            source.finish(actors, pids, clean)
            if reward_actor is not None:
                source.finish_reward(reward_actor, clean)
        if cfg.engine.faults:  # the marks of the faults this run's processes fired
            forget_fired(a._actor_id.hex() for a in [*actors.values(), reward_actor] if a is not None)
        disconnect(ours)


def form_trainer_group(layout: RunLayout, actors: dict, ready: dict) -> None:
    """The trainer ranks (roles trainer / both) form one torch.distributed group, in the layout's
    rank order; each FSDP shard group's first rank leads the others."""
    import ray

    ranks = layout.trainer_ranks
    if len(ranks) < 2:
        return
    backend = "nccl" if all(ready[r]["device"].startswith("cuda") for r in ranks) else "gloo"
    address, port = ray.get(actors[ranks[0]].rendezvous_address.remote())
    ray.get([actors[r].join_group.remote(address, port, i, len(ranks), backend) for i, r in enumerate(ranks)])
    for (
        lead,
        *others,
    ) in layout.shard_groups:  # a shard group's first rank leads the others through every call
        ray.get(actors[lead].lead.remote({r: actors[r] for r in others}))


def form_sync_group(layout: RunLayout, actors: dict) -> tuple[str, list[str], tuple[str, int] | None]:
    """The layout's weight sync: over ``broadcast``, trainer rank 0 (group rank 0) and the rollout
    workers form the weight-sync group (its own TCP store and port, beside the trainer ranks'
    group). Returns the transport, the group's rollout workers and the address of its store (the
    driver takes the group down through it); with the fallback (``auto``) the object store, with a
    warning, when the group does not form."""
    import ray

    workers = layout.workers
    rollout = [w.name for w in workers if w.role == "rollout"]
    if layout.settings.weight_sync != "broadcast":
        return "object_store", [], None
    from digenrl.engine.sync_group import SYNC_TIMEOUT_S, sync_backend

    members = [next(w.name for w in workers if w.role != "rollout"), *rollout]
    found = ray.get([actors[m].sync_specs.remote() for m in members])
    backend = sync_backend([f["device"] for f in found], layout)
    address, port = ray.get(actors[members[0]].rendezvous_address.remote())
    try:
        ray.get(
            [
                actors[m].join_sync.remote(
                    address, port, i, len(members), backend, found[1]["specs"] if i == 0 else None
                )
                for i, m in enumerate(members)
            ],
            timeout=SYNC_TIMEOUT_S + 30,
        )
    except Exception as exc:  # noqa: BLE001
        cause = getattr(exc, "cause", None)
        if isinstance(
            cause, WeightSyncError
        ):  # the two sides disagree on the weights: no fallback hides that
            raise cause from None
        if not layout.settings.weight_sync_fallback:
            raise UserError(
                f"engine.weight_sync: broadcast: trainer rank 0 and the rollout workers could not form "
                f"a process group ({first_line(exc, typed=True)}); use auto or object_store"
            ) from None
        ray.get([actors[m].leave_sync.remote() for m in members])
        print(
            f"warning: engine.weight_sync: auto: no {backend} group between trainer rank 0 and the rollout "
            f"workers ({first_line(exc, typed=True)}); weights go through the Ray object store",
            file=sys.stderr,
        )
        return "object_store", [], None
    return "broadcast", rollout, (address, port)


def form_sp_groups(layout: RunLayout, actors: dict, ready: dict) -> None:
    """Each sequence-parallel rollout group forms its own torch.distributed group (nccl on GPU,
    gloo on CPU) and runs its transformer with Ulysses over it (trainer groups did so when the
    trainer ranks joined theirs); each lead takes its followers."""
    import ray

    for names in layout.rollout_sp_groups:
        form_rollout_sp_group(actors, names, [ready[n]["device"] for n in names])
    if layout.shard_groups:  # FSDP: trainer rank 0 already leads every other rank
        return
    for names in layout.trainer_sp_groups:  # (their group formed with the trainer group's)
        ray.get(actors[names[0]].lead.remote({n: actors[n] for n in names[1:]}))


def form_rollout_sp_group(actors: dict, names, devices: list[str] | None = None) -> None:
    """One sequence-parallel rollout group (``names``, its lead first) joins its own torch.distributed
    world and the lead takes its followers; again when the group was restarted whole."""
    import ray

    if devices is None:  # the group restarted whole: its members may come back one by one
        devices = [f["device"] for f in when_back(actors, names)]
    backend = "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"
    address, port = ray.get(actors[names[0]].rendezvous_address.remote())
    ray.get(
        [actors[n].join_sp_group.remote(address, port, i, len(names), backend) for i, n in enumerate(names)]
    )
    ray.get(actors[names[0]].lead.remote({n: actors[n] for n in names[1:]}))


RESTART_WAIT_S = 300.0  # how long a restarted group's members may take to come back (each rebuilds its model)


def when_back(actors: dict, names) -> list[dict]:
    """Each of ``names``' ``sync_specs()`` once Ray has restarted it: a member still restarting answers
    ActorUnavailableError, so ask again (every 0.5 s, up to RESTART_WAIT_S)."""
    import time

    import ray

    deadline = time.time() + RESTART_WAIT_S
    while True:
        try:
            return ray.get([actors[n].sync_specs.remote() for n in names])
        except ray.exceptions.ActorUnavailableError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)
