"""The Ray cluster the engine runs on and the resources a placement asks of it.

Details: docs/modules.md, `digenrl.engine.resources`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
from collections import Counter

from digenrl.config.engine import PoolConfig
from digenrl.config.run import RunConfig
from digenrl.engine.head_watch import probe
from digenrl.errors import UserError
from digenrl.placement.plan import Worker

PG_SHARE = re.compile(r"_group_(\d+_)?[0-9a-f]{20,}$")  # a placement group's share of a resource (Ray's)
PLACEMENT_TIMEOUT_S = 30.0  # resources exist but stay taken (other jobs): give up, say so


ADDRESS_PROBE_S = 3.0  # a wrong --ray-address must fail fast


class PlacementError(UserError):
    """The cluster cannot hold the run's workers (exit code 2): too few devices of a pool, or none free."""


def reserve(bundles: list[dict], workers: list[Worker], strategy: str = "PACK"):
    """A placement group of ``bundles``, once reserved (a UserError naming the ask after
    PLACEMENT_TIMEOUT_S: the resources exist but stay taken)."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise PlacementError(
            f"cluster: could not reserve {_asked(workers)} within {PLACEMENT_TIMEOUT_S:.0f}s "
            f"(bundles {bundles}); free now: {_describe(ray.available_resources())}"
        ) from None
    return group


def head_problem() -> str | None:
    """Why the connected cluster's head (GCS) does not accept connections, or None when it does."""
    import ray

    return probe(ray.get_runtime_context().gcs_address, timeout=ADDRESS_PROBE_S)


def connect(workers: list[Worker], ray_address: str | None) -> bool:
    """Join ``ray_address``, or start a local cluster whose logical resources are the CPU pools.
    Returns True when this call connected (and so must :func:`disconnect`). A connection left to a
    cluster whose head died (by a run that stopped for it) is closed first."""
    import ray

    if ray.is_initialized() and head_problem() is not None:
        ray.shutdown()
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


def disconnect(ours: bool) -> None:
    """Leave the cluster :func:`connect` joined (``ours``), unless its head (GCS) is gone: then the
    connection stays until the next :func:`connect` or the process's exit. Ray's shutdown against a
    dead head waits ~5 s, and its core worker may end the process on the way (it exits when it
    finds the local raylet dead), before the run's error is reported."""
    import ray

    if ours and head_problem() is None:
        session = _session_dir()
        ray.shutdown()
        if session in _STARTED:  # a local cluster this process started: its session directory goes too
            remove_session(session)


def forget_dead_head() -> None:
    """At the process's end: a connection left to a dead head (:func:`disconnect`) is not shut down
    by Ray's exit handler: it waits ~5 s for the dead head, after the run's line, for nothing."""
    import atexit

    import ray

    if ray.is_initialized() and head_problem() is not None:
        atexit.unregister(ray.shutdown)


#: the session directories (Ray's temp dir, /tmp/ray/session_*) of the local clusters started here
_STARTED: set[str] = set()


def _session_dir() -> str | None:
    """The connected cluster's session directory on this host (Ray keeps its logs and sockets there)."""
    import ray._private.worker as worker

    node = getattr(worker, "_global_node", None)
    try:
        return node.get_session_dir_path() if node is not None else None
    except Exception:  # noqa: BLE001  (a private API: without it, the directory is simply kept)
        return None


def remove_session(session: str | None) -> None:
    """Delete a finished local cluster's session directory, and Ray's ``session_latest`` link when it
    points there: one per run would pile up in Ray's temp dir (49 in an afternoon of runs)."""
    import shutil

    if not session:
        return
    _STARTED.discard(session)
    shutil.rmtree(session, ignore_errors=True)
    latest = os.path.join(os.path.dirname(session), "session_latest")
    if os.path.islink(latest) and os.path.realpath(latest) == os.path.realpath(session):
        os.unlink(latest)


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
    # address="local": never join a cluster another process started with `ray start` on this host
    ray.init(address="local", resources=resources, **{**defaults, **options})
    _STARTED.add(_session_dir())
    return True


def nodes_gone(workers_on: dict[str, list[str]]) -> list[str]:
    """Which of the Ray nodes in ``workers_on`` (node id -> the run's workers on it) have left the
    cluster, each as ``node ID (its workers)``: marked dead by Ray, or alive to Ray but with a raylet
    that refuses connections (Ray's health check notices a lost node only after missed checks)."""
    import ray

    gone = []
    for node in ray.nodes():
        names = workers_on.get(node["NodeID"])
        if names is None or (
            node.get("Alive") and _answers(node["NodeManagerAddress"], node["NodeManagerPort"])
        ):
            continue
        gone.append(f"node {node['NodeID'][:12]} (with {', '.join(names)})")
    return gone


def _answers(host, port) -> bool:
    try:
        socket.create_connection((host, port), timeout=ADDRESS_PROBE_S).close()
        return True
    except (OSError, TypeError, ValueError):
        return False


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
        raise PlacementError(
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
    """What a user asked of the cluster (not Ray's own: nodes, memory, placement groups' shares)."""
    keep = {
        k: v
        for k, v in resources.items()
        if not k.startswith("node:") and not PG_SHARE.search(k) and k not in ("memory", "object_store_memory")
    }
    return ", ".join(f"{k} {v:g}" for k, v in sorted(keep.items())) or "no resources"


def reserve_by_node(bundles: list[dict], workers: list[Worker], node_groups):
    """Placement groups for the run: one STRICT_PACK group per set of workers that must share a node
    (their collectives run every forward), one PACK group for the rest. Returns the groups and, per
    worker, its (group, bundle index)."""
    names = [w.name for w in workers]
    sets = [[names.index(n) for n in g] for g in node_groups]
    rest = [i for i in range(len(workers)) if not any(i in s for s in sets)]
    groups, slots = [], [None] * len(workers)
    for members, strategy in [(s, "STRICT_PACK") for s in sets] + [(rest, "PACK")] * bool(rest):
        groups.append(reserve([bundles[i] for i in members], workers, strategy))
        for k, i in enumerate(members):
            slots[i] = (groups[-1], k)
    return groups, slots
