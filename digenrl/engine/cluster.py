"""Ray plumbing for the engine: the cluster, the actors, and what a fault looks like from the driver.

Placement is data: pools map to Ray resources. A CPU pool is a logical custom resource
``pool:<name>`` (a local run creates them; a joined cluster must have them), a GPU pool asks
for ``num_gpus=1`` plus its type (Ray's ``accelerator_type:<TYPE>`` or a custom resource named
after the type; ``gpu`` / ``cuda`` = any GPU). Everything is reserved as one placement group
after checking ``ray.cluster_resources()``, so an impossible placement fails in seconds with
a message, never a hang.

Faults: ``num_restarts`` reads Ray's count (:func:`digenrl.errors.actor_died` tells a dead process
from a bug; what the engine does about a fault is :mod:`digenrl.engine.recovery`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
import uuid
from collections import Counter
from pathlib import Path

from digenrl.config.engine import PoolConfig
from digenrl.config.run import RunConfig
from digenrl.engine import warm
from digenrl.engine.faults import FaultInjector
from digenrl.errors import UserError, WeightSyncError
from digenrl.placement.layout import RunLayout
from digenrl.placement.plan import Worker
from digenrl.progress import progress

REWARD_ROW = "reward"  # the reward actor's timeline row (pool SERVICE_POOL), and its in-flight entries
PLACEMENT_TIMEOUT_S = 30.0  # resources exist but stay taken (other jobs): give up, say so
RETIRE_TIMEOUT_S = 30.0  # warm workers: emptying a finished run's actors for the next one
ADDRESS_PROBE_S = 3.0  # a wrong --ray-address must fail fast


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


def first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


# ------------------------------------------------------------------- Ray: cluster and actors


@contextlib.contextmanager
def ray_workers(cfg: RunConfig, layout: RunLayout, ray_address: str | None, resume: Path | None = None):
    """Connect (or start Ray), check and reserve the placement, start one actor per worker of the
    ``layout`` (each gets it) and wait until every one has built its policy (from the ``resume``
    checkpoint directory when given: read by path); on exit kill them and release everything."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from digenrl.engine.workers import SCORE_GROUP, EngineWorker, ResumeFrom, rollout_checkpoint_files
    from digenrl.rewards import scored_after_unit

    progress(
        "starting the Ray cluster..."
        if ray_address is None
        else f"joining the Ray cluster at {ray_address}..."
    )
    workers = layout.workers
    ours = connect(workers, ray_address)
    actors, reward_actor, pids, clean = {}, None, {}, False
    after = scored_after_unit(cfg)
    scoring = [after and spec.role == "rollout" for spec in workers]
    restarts = [cfg.engine.max_restarts if spec.role == "rollout" else 0 for spec in workers]
    pool = warm.active() if not ours else None  # warm workers: keep the actors for the next run
    if pool is not None and not warm.eligible(cfg):  # this run starts fresh ones: release the kept
        pool.clear()
        pool = None
    groups, kinds, kept, keys = [], [], [None] * len(workers), []
    try:
        progress(f"starting {len(workers)} workers (each builds the model)...")
        bundles = resource_bundles(workers, ray.cluster_resources(), reserve=reward_service_resources(cfg))
        if pool is None:  # a shard / SP group on one node each (STRICT_PACK), the other workers packed
            groups, slots = _reserve_by_node(bundles, workers, layout.node_groups)
        else:  # warm workers: one reservation per actor, so each can be kept or released alone
            kinds = [warm.kind_of(b, s, r) for b, s, r in zip(bundles, scoring, restarts)]
            kept = pool.take([w.name for w in workers], kinds, ray.cluster_resources())
            keys = [k.key if k is not None else uuid.uuid4().hex for k in kept]  # entries on its board
            for k, kd in zip(kept, kinds):
                groups.append(k.group if k is not None else _reserve([warm.bundle_of(kd)], workers))
            slots = [(g, 0, warm.bundle_of(kd)) for g, kd in zip(groups, kinds)]
        if cfg.reward.service is not None:  # one reward actor shared by every worker that scores
            from digenrl.rewards.service import start_reward_actor

            reward_actor = start_reward_actor(
                cfg.reward,
                max_restarts=cfg.engine.max_restarts,
                faults=FaultInjector.from_config(cfg, REWARD_ROW),
            )
        resume_from = None
        if resume is not None:  # rollout workers' fallback copy: never the optimizer state
            resume_from = ResumeFrom(str(Path(resume).resolve()), ray.put(rollout_checkpoint_files(resume)))
        remote = ray.remote(EngineWorker)
        # a model reward scored after each unit: the rollout workers' score() runs beside their next unit
        scored = ray.remote(concurrency_groups={SCORE_GROUP: 1})(EngineWorker)
        sp_followers = layout.sp_followers
        calls = []
        for i, spec in enumerate(workers):
            scorer = None if spec.name in sp_followers else reward_actor
            args = (cfg, spec.name, spec.role, scorer, resume_from)
            kwargs = dict(sp_follower=spec.name in sp_followers, layout=layout)
            # a warm actor restarted by Ray builds what the pool posted for it, not its first run's worker
            extra = {} if pool is None else dict(restart_from=pool.post(keys[i], args, kwargs))
            if kept[i] is not None:  # a warm actor: the same process, this run's worker built in it
                actors[spec.name] = kept[i].actor
                calls.append(kept[i].actor.rebuild.remote(*args, **kwargs))
                continue
            group, index, b = slots[i]
            actors[spec.name] = (
                (scored if scoring[i] else remote)
                .options(
                    num_cpus=b.get("CPU", 0),
                    num_gpus=b.get("GPU", 0),
                    runtime_env=device_env(b.get("GPU", 0)),
                    resources={k: v for k, v in b.items() if k not in ("CPU", "GPU")},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=index
                    ),
                    # a rollout worker holds nothing that cannot be rebuilt: Ray restarts it and the
                    # engine re-queues its unit; a trainer rank's death stops the run (worker_died)
                    # (a sequence-parallel group is restarted whole: recovery.GroupRestart)
                    max_restarts=restarts[i],
                    max_task_retries=0,
                )
                .remote(*args, **kwargs, **extra)
            )
            calls.append(actors[spec.name].ready.remote())
        ready = dict(zip(actors, ray.get(calls)))
        pids = {name: r["pid"] for name, r in ready.items()}
        if len({r["checksum"] for r in ready.values()}) > 1:
            raise WeightSyncError(f"initial weights differ between workers: {ready}")
        form_trainer_group(layout, actors, ready)
        form_sp_groups(layout, actors, ready)
        yield {**actors, REWARD_ROW: reward_actor} if reward_actor is not None else actors
        clean = True
    finally:
        if head_problem() is None:  # with the head gone, every call below would wait a minute for it
            # (and the cluster took its processes along)
            back = _retired(actors, pids) if clean and pool is not None else set()
            if pool is not None:  # warm workers: keep those back empty, as they started; the rest go
                stay = [i for i, w in enumerate(workers) if w.name in back]
                names = [w.name for w in workers]
                pool.keep([warm.Kept(names[i], kinds[i], groups[i], actors[names[i]], keys[i]) for i in stay])
                pool.forget([key for i, key in enumerate(keys) if i not in stay])
                groups = [g for i, g in enumerate(groups) if i not in stay]
            taken = [k.actor for k in kept if k is not None and k.actor not in actors.values()]
            gone = [a for name, a in actors.items() if name not in back]
            for actor in [*gone, *taken, reward_actor]:
                if actor is not None:
                    ray.kill(actor, no_restart=True)
            for group in groups:
                remove_placement_group(group)
        if ours:
            ray.shutdown()


def _reserve(bundles: list[dict], workers: list[Worker], strategy: str = "PACK"):
    """A placement group of ``bundles``, once reserved (a UserError naming the ask after
    PLACEMENT_TIMEOUT_S: the resources exist but stay taken)."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise UserError(
            f"cluster: could not reserve {_asked(workers)} within {PLACEMENT_TIMEOUT_S:.0f}s "
            f"(bundles {bundles}); free now: {_describe(ray.available_resources())}"
        ) from None
    return group


def _reserve_by_node(bundles: list[dict], workers: list[Worker], node_groups):
    """Placement groups for the run: one STRICT_PACK group per set of workers that must share a node
    (their collectives run every forward), one PACK group for the rest. Returns the groups and, per
    worker, its (group, bundle index, bundle)."""
    names = [w.name for w in workers]
    sets = [[names.index(n) for n in g] for g in node_groups]
    rest = [i for i in range(len(workers)) if not any(i in s for s in sets)]
    groups, slots = [], [None] * len(workers)
    for members, strategy in [(s, "STRICT_PACK") for s in sets] + [(rest, "PACK")] * bool(rest):
        groups.append(_reserve([bundles[i] for i in members], workers, strategy))
        for k, i in enumerate(members):
            slots[i] = (groups[-1], k, bundles[i])
    return groups, slots


def _retired(actors: dict, pids: dict) -> set[str]:
    """Empty every worker of a finished run for the next one (warm workers): the names of those that
    came back empty in the process they started the run in (not restarted)."""
    import ray

    calls = {name: a.retire.remote() for name, a in actors.items()}
    ray.wait(list(calls.values()), num_returns=len(calls), timeout=RETIRE_TIMEOUT_S)
    back = set()
    for name, call in calls.items():
        try:
            if ray.get(call, timeout=0) == pids[name]:
                back.add(name)
        except Exception:  # noqa: BLE001 -- a worker that cannot retire (or not yet) is killed
            pass
    return back


def head_problem() -> str | None:
    """Why the connected cluster's head (GCS) does not accept connections, or None when it does."""
    import ray

    try:
        socket.create_connection(
            host_port(ray.get_runtime_context().gcs_address), timeout=ADDRESS_PROBE_S
        ).close()
        return None
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)


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
                f"a process group ({first_line(exc)}); use auto or object_store"
            ) from None
        ray.get([actors[m].leave_sync.remote() for m in members])
        print(
            f"warning: engine.weight_sync: auto: no {backend} group between trainer rank 0 and the rollout "
            f"workers ({first_line(exc)}); weights go through the Ray object store",
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


def connect(workers: list[Worker], ray_address: str | None) -> bool:
    """Join ``ray_address``, or start a local cluster whose logical resources are the CPU pools.
    Returns True when this call connected (and so must disconnect)."""
    import ray

    if ray_address is None:
        pools = {w.pool.name: w.pool for w in workers}
        return start_local({f"pool:{p.name}": p.count for p in pools.values() if p.device.lower() == "cpu"})
    _probe(ray_address)
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if _same_address(ray_address, current):
            return False
        raise UserError(
            f"ray address {ray_address}: this process is already connected to the Ray cluster at {current}"
        )
    try:
        ray.init(address=ray_address, logging_level=logging.WARNING)
    except Exception as exc:  # ConnectionError, RuntimeError, ...: all mean "not a usable cluster"
        raise UserError(f"ray address {ray_address}: could not join a Ray cluster there ({exc})") from None
    return True


def start_local(resources: dict[str, float], **options) -> bool:
    """Be connected to a local Ray cluster with the logical devices ``resources``: the one this process
    is connected to already (the caller's -- a test suite, a notebook, a benchmark's loop -- used as it
    is and left up), else one started here on every core, without the dashboard, with Ray's warnings
    only (``options`` go to ``ray.init``). True when this call started it: the caller shuts it down."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    defaults = dict(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    ray.init(resources=resources, **{**defaults, **options})
    return True


def _probe(address: str) -> None:
    """Fail in seconds when nothing listens at the address (ray.init would retry for a minute)."""
    if address == "auto":
        return
    host, port = host_port(address)
    try:
        socket.create_connection((host, port), timeout=ADDRESS_PROBE_S).close()
    except (OSError, ValueError) as exc:
        raise UserError(
            f"ray address {address}: no Ray cluster answers there ({exc}); start one with "
            "`ray start --head` or leave the address out to run on a local cluster"
        ) from None


def host_port(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not host:
        return rest, 10001 if address.startswith("ray://") else 6379
    try:
        return host, int(port)
    except ValueError:
        raise UserError(f"ray address {address}: expected host:port") from None


def _same_address(a: str, b: str) -> bool:
    (ha, pa), (hb, pb) = host_port(a), host_port(b)
    try:
        return pa == pb and socket.gethostbyname(ha) == socket.gethostbyname(hb)
    except OSError:
        return False


def reward_service_resources(cfg: RunConfig) -> dict[str, float]:
    """What the reward actor (``reward.service``) asks for, beside the placement group."""
    svc = cfg.reward.service
    if svc is None:
        return {}
    need = {"CPU": svc.num_cpus, "GPU": svc.num_gpus, **svc.resources}
    return {k: v for k, v in need.items() if v > 0}


def resource_bundles(
    workers: list[Worker], have: dict, reserve: dict[str, float] | None = None
) -> list[dict]:
    """One placement-group bundle per worker: its device plus a CPU share that fits the cluster
    beside ``reserve`` (the reward actor's request; fractional requests beyond the CPUs would
    wait forever). Raises UserError, naming what was asked and what exists, when the cluster
    cannot hold them."""
    reserve = reserve or {}
    free_cpus = max(0.0, have.get("CPU", 0) - reserve.get("CPU", 0))
    share = math.floor(min(1.0, free_cpus / len(workers)) * 100) / 100
    bundles = []
    for w in workers:
        bundle = {"CPU": share} if share > 0 else {}
        bundle.update(_device_resources(w.pool, have))
        bundles.append(bundle)
    need = Counter(reserve)
    for b in bundles:
        need.update(b)
    short = [
        f"{k} {v:g} needed, {have.get(k, 0):g} exist" for k, v in need.items() if have.get(k, 0) < v - 1e-9
    ]
    if short:
        extra = f" + the reward actor ({_describe(reserve)})" if reserve else ""
        raise UserError(
            f"cluster: cannot place {_asked(workers)}{extra}: {'; '.join(short)}. "
            f"The Ray cluster has {_describe(have)}"
        )
    return bundles


def _device_resources(pool: PoolConfig, have: dict) -> dict:
    device = pool.device
    if device.lower() == "cpu":
        return {f"pool:{pool.name}": 1}
    if device.lower() in ("gpu", "cuda"):
        return {"GPU": 1}
    for key in have:  # Ray's detected type (1 per node, so a tiny share) or a custom resource
        if key.lower() == f"accelerator_type:{device}".lower():
            return {"GPU": 1, key: 0.001}
    for key in have:
        if key.lower() == device.lower():
            return {"GPU": 1, key: 1}
    raise UserError(
        f"cluster.pools: pool '{pool.name}' asks for device type '{device}', which the Ray cluster "
        f"does not have (it has {_describe(have)}); use 'cpu' (logical), 'gpu' (any GPU) or a type "
        "Ray reports as accelerator_type:<TYPE>"
    )


def _asked(workers: list[Worker]) -> str:
    counts = Counter((w.pool.name, w.pool.device) for w in workers)
    return ", ".join(f"{n} x {device} for pool '{name}'" for (name, device), n in counts.items())


def _describe(resources: dict) -> str:
    keep = {
        k: v
        for k, v in resources.items()
        if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }
    return ", ".join(f"{k} {v:g}" for k, v in sorted(keep.items())) or "no resources"
