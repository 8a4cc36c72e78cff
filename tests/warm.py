"""Warm workers: the test suite keeps a finished run's actors for the next run.

This is the suite's actor source (``digenrl.engine.cluster.actor_source``, the runtime's one hook for
it): the runtime itself always starts fresh actors.

Starting an engine actor costs ~5 s of CPU before it builds anything (importing torch, Ray and
diffusers' model classes: docs/engine.md "Where a run's actors come from"), and a tiny run is over
in about one second. Inside :func:`warm_workers` the end of a run leaves its actors alive and empty
(``EngineWorker.retire``); the next run takes the kept actors of the kinds it needs -- the same
device resource, the same restart budget -- and builds its workers in them
(:meth:`WarmWorker.rebuild`), starting fresh actors only for the rest; kept actors it does not take
stay kept unless the actors it starts need their devices. The test suite runs
inside it (tests/conftest.py); a single ``digenrl train`` never does.

What changes inside: each warm actor holds its own one-bundle placement group (so one can be kept
and another released) with a small fixed CPU share (so kept and new actors always fit together),
where a run without warm workers reserves all its workers as one placement group; and every warm
actor has the scoring concurrency group, which only the runs with a model reward scored beside the
next unit use.

Ray restarts a lost actor by calling its constructor with the arguments it was created with: for a
kept actor, an earlier run's. So every warm actor is created with a handle to the pool's
:class:`ArgsBoard`, where the driver posts the arguments of the worker it builds in that actor for
each run (:meth:`WarmPool.post`); a restarted warm actor builds what the board says
(:class:`WarmWorker`'s ``restart_from``). Runs with injected faults use warm actors too.

Fresh actors, always, where a kept process could carry something over: a compiled transformer
(dynamo's caches). After a run that finished, or one refused while its workers built (bad input,
raised by their ``ready``: no process group or thread exists yet), the actors that come back empty
in the process they started the run in are kept, the others (restarted ones) killed; after a run
that failed later, the same within a few seconds (a worker still busy is killed), unless its rollout
workers scored beside their units: then every actor is killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import uuid
from collections import Counter
from dataclasses import dataclass

from digenrl.distributed.fsdp import forget_meshes
from digenrl.engine import sync_group
from digenrl.engine.cluster import FreshActors, actor_source, new_actor
from digenrl.engine.groups import abort_process_group
from digenrl.engine.resources import reserve
from digenrl.engine.worker_setup import restarted
from digenrl.engine.workers import EngineWorker
from tests.warm_board import ArgsBoard
from tests.warm_rewards import WarmRewards

#: A warm actor's CPU share (logical): small enough that any run's workers fit beside kept ones.
CPU_SHARE = 0.05
RETIRE_WAIT_S = 10.0  # how long a retiring rollout worker waits for its weight-sync thread
RETIRE_TIMEOUT_S = 30.0  # emptying a finished run's actors for the next one
FAILED_RETIRE_TIMEOUT_S = 5.0  # the same after a failed run (the rest are killed)

_active: WarmPool | None = None  # the pool of the warm_workers() block this process is in


@dataclass
class Kept:
    name: str  # the worker it ran last (taken first by that worker again: see WarmPool.take)
    kind: tuple  # what fixes an actor at creation (see kind_of)
    group: object  # its one-bundle placement group
    actor: object
    key: str = ""  # its entry on the pool's ArgsBoard


def posted_args(restart_from: tuple) -> tuple[tuple, dict]:
    """In a restarted warm actor: the ``(args, kwargs)`` the driver posted for it (``restart_from`` is
    ``(board, key)``, given at creation)."""
    import ray

    board, key = restart_from
    (ref,) = ray.get(board.get.remote(key))
    return ray.get(ref)


class WarmPool:
    """The actors kept by this process's finished runs, and what they saved (``reused``/``started``)."""

    def __init__(self):
        self.kept: list[Kept] = []
        self.reused = self.started = 0
        self.board = None  # the ArgsBoard actor, started with the first warm actor
        self.refs: dict[str, object] = {}  # key -> the ObjectRef posted for it (owned here)
        self.rewards = WarmRewards()  # the reward actor a finished run kept (tests/warm_rewards.py)

    def post(self, key: str, args: tuple, kwargs: dict) -> tuple:
        """Post the constructor arguments of the worker built next in the warm actor ``key`` (before
        it is created or rebuilt); returns its ``restart_from``: ``(board, key)``."""
        import ray

        if self.board is None:
            self.board = ray.remote(num_cpus=0)(ArgsBoard).remote()
        self.refs[key] = ray.put((args, kwargs))
        ray.get(self.board.put.remote(key, [self.refs[key]]))
        return self.board, key

    def forget(self, keys: list[str]) -> None:
        """The actors ``keys`` are gone: their posts go too."""
        import ray

        keys = [k for k in keys if self.refs.pop(k, None) is not None]
        if keys and self.board is not None and ray.is_initialized():  # (a cluster gone took the board)
            self.board.drop.remote(keys)

    def take(self, names: list[str], kinds: list[tuple], total: dict[str, float]) -> list[Kept | None]:
        """For each of a run's workers (``names``, ``kinds``, in order), a kept actor of its kind
        (handed over: no longer kept), or None: the one that last ran the worker of that name, else
        any other of the kind. The kept actors not taken stay kept unless the workers to start need
        their devices (of the cluster's ``total``): those are released.

        Any of the kind: what torch keeps per process across runs -- DTensor's caches, which hold a
        mesh and its coordinates -- ``WarmWorker.retire`` clears
        (:func:`digenrl.distributed.fsdp.forget_meshes`), so a process that was trainer1 can be
        trainer0 next (tests/test_warm.py). The same name first keeps the reuse predictable."""
        left = list(self.kept)
        out = [_pop(left, lambda k: k.name == name and k.kind == kind) for name, kind in zip(names, kinds)]
        out = [got or _pop(left, lambda k: k.kind == kind) for got, kind in zip(out, kinds)]
        need = _sum(bundle_of(kd) for kd, k in zip(kinds, out) if k is None)
        while left:
            held = _sum(bundle_of(k.kind) for k in [*left, *filter(None, out)])
            short = [r for r, v in need.items() if held.get(r, 0) + v > total.get(r, 0) + 1e-9]
            if not short:
                break
            gone = next((k for k in left if any(r in bundle_of(k.kind) for r in short)), None)
            if gone is None:  # no kept actor holds what is short: releasing one would not help
                break
            left.remove(gone)
            release([gone])
            self.forget([gone.key])
        self.kept = left
        self.reused += sum(k is not None for k in out)
        self.started += sum(k is None for k in out)
        return out

    def keep(self, kept: list[Kept]) -> None:
        self.kept.extend(kept)

    def held(self) -> dict[str, float]:
        """The Ray resources the kept actors' reservations hold."""
        return _sum(bundle_of(k.kind) for k in self.kept)

    def clear(self) -> None:
        kept, self.kept = self.kept, []
        release(kept)
        self.forget([k.key for k in kept])
        self.rewards.clear()


def _pop(kept: list[Kept], match) -> Kept | None:
    """The first of ``kept`` that ``match``es, removed from it; or None."""
    found = next((k for k in kept if match(k)), None)
    if found is not None:
        kept.remove(found)
    return found


def _sum(bundles) -> dict[str, float]:
    return dict(sum((Counter(b) for b in bundles), Counter()))


def release(kept: list[Kept]) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    if not kept or not ray.is_initialized():  # (the cluster gone took its processes along)
        return
    for k in kept:
        ray.kill(k.actor, no_restart=True)
        remove_placement_group(k.group)


def active() -> WarmPool | None:
    """The pool this process's runs keep their actors in, or None (every run starts its own)."""
    return _active


@contextlib.contextmanager
def warm_workers():
    """Keep each run's actors for the next runs in this process; on exit kill whatever is kept."""
    global _active
    if _active is not None:
        raise RuntimeError("warm_workers() is already active in this process")
    _active = WarmPool()
    try:
        with actor_source(WarmActors(_active)):
            yield _active
    finally:
        pool, _active = _active, None
        pool.clear()
        if pool.board is not None:
            import ray

            if ray.is_initialized():  # (a cluster gone took the board along)
                ray.kill(pool.board, no_restart=True)


def eligible(cfg) -> bool:
    """Whether a run may use (and leave) warm actors (module docstring)."""
    return cfg.engine.compile_rollout != "on"


def kind_of(bundle: dict, max_restarts: int) -> tuple:
    """What an actor is created with and a rebuild cannot change: its device resources (its
    bundle without the CPU share) and its restart budget. Not the scoring concurrency group: every
    warm actor has it (:meth:`WarmActors.start`), used by the runs that score and idle in the rest."""
    return (tuple(sorted((k, v) for k, v in bundle.items() if k != "CPU")), max_restarts)


def bundle_of(kind: tuple) -> dict:
    """The one-bundle reservation of a warm actor of ``kind``."""
    return {"CPU": CPU_SHARE, **dict(kind[0])}


class WarmWorker(EngineWorker):
    """An engine worker that can be emptied (:meth:`retire`) and built again as the next run's
    (:meth:`rebuild`) in the same process; restarted by Ray, it builds what its pool's board says."""

    def __init__(self, *args, restart_from: tuple | None = None, **kwargs):
        if restart_from is not None and restarted():
            args, kwargs = posted_args(restart_from)
        super().__init__(*args, **kwargs)

    def rebuild(self, *args, **kwargs) -> None:
        """Build the next run's worker in this live process (the constructor's arguments), unfrozen:
        what stays in the process is frozen already (:func:`collect_the_run`)."""
        self.__dict__.clear()
        self.freeze_build = False
        EngineWorker.__init__(self, *args, **kwargs)

    def retire(self) -> int | None:
        """The end of a run whose process is kept: leave its process groups, stop the weight-sync
        thread, drop everything it built. Returns this process's id, or None when something is
        still running in it or Ray restarted it (the driver then kills it). Also after a build that
        failed (``init_error``): what it built, if anything, goes."""
        if restarted():
            return None
        sync = getattr(self, "sync", None)  # (absent when the build failed before it)
        inbox = sync if isinstance(sync, sync_group.BroadcastInbox) else None
        if isinstance(sync, sync_group.BroadcastPublisher):
            sync.close()  # the receivers' threads end
        if inbox is not None and not inbox.stopped(timeout=RETIRE_WAIT_S):
            return None
        abort_process_group()
        forget_meshes()  # the next run's meshes may look equal to this one's with other coordinates
        self.__dict__.clear()
        collect_the_run()
        return os.getpid()


_refrozen = False  # (in a warm actor's process) whether its first retire has run collect_the_run


def collect_the_run() -> None:
    """Collect what the finished run left in reference cycles. A first build froze everything
    (``workers.gc_paused_then_frozen``): the first time, unfreeze, collect, and freeze again what
    stays (the imports, ~5x10^5 objects). Later builds are not frozen (:meth:`WarmWorker.rebuild`), so
    later collections traverse only the run's ~10^4 objects: ~0.36 s of CPU saved per retire."""
    global _refrozen
    if _refrozen:
        gc.collect()
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _refrozen = True


class WarmActors:
    """The actor source of runs inside :func:`warm_workers` (``cluster.actor_source``): kept actors
    of the right kind rebuilt, the rest started, each in its own one-bundle placement group."""

    def __init__(self, pool: WarmPool):
        self.pool = pool
        self.fresh = None  # a run that may not use warm actors starts fresh ones (eligible)
        self.open = False  # between a run's start and its finish

    def start(self, cfg, plans, workers, node_groups=()) -> dict:
        import ray

        if not eligible(cfg):  # this run starts fresh ones: release the kept first
            self.pool.clear()
            self.fresh = FreshActors()
            return self.fresh.start(cfg, plans, workers, node_groups)
        self.fresh, self.open, self.names = None, True, [p.name for p in plans]
        self.kinds = [kind_of(p.bundle, p.max_restarts) for p in plans]
        self.scoring = any(p.scoring for p in plans)
        self.groups, self.keys, self.kept = [], [], [None] * len(plans)
        self.kept = self.pool.take([p.name for p in plans], self.kinds, ray.cluster_resources())
        self.keys = [k.key if k is not None else uuid.uuid4().hex for k in self.kept]  # on the board
        self.groups = [
            k.group if k is not None else reserve([bundle_of(kd)], workers)
            for k, kd in zip(self.kept, self.kinds)
        ]
        actors = {}
        for i, p in enumerate(plans):
            # a warm actor restarted by Ray builds what the pool posted for it, not its first run's worker
            restart_from = self.pool.post(self.keys[i], p.args, p.kwargs)
            if self.kept[i] is not None:  # the same process, this run's worker built in it
                actors[p.name] = self.kept[i].actor
                actors[p.name].rebuild.remote(*p.args, **p.kwargs)
                continue
            # its one-bundle reservation, and the scoring group whether or not this run scores: a
            # kind fewer, so a run that scores and one that does not take the same kept actors
            small = dataclasses.replace(p, bundle=bundle_of(self.kinds[i]), scoring=True)
            actors[p.name] = new_actor(small, self.groups[i], 0, WarmWorker, restart_from=restart_from)
        return actors

    def start_reward(self, cfg, faults):
        return self.pool.rewards.start(cfg, faults)

    def finish_reward(self, actor, clean: bool) -> None:
        self.pool.rewards.finish(actor, clean)

    def finish(self, actors: dict, pids: dict, clean: bool) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.fresh is not None:
            return self.fresh.finish(actors, pids, clean)
        if not self.open:  # the run failed before it asked for actors: nothing of it to release
            return
        self.open = False
        # A run that finished, or one refused while its workers built (bad input: ``ready`` raised,
        # so no ``pids``, no process group or thread yet), leaves its processes clean: they are
        # emptied and kept. After a failure later in a run, the workers that empty themselves within
        # a few seconds are kept too (a fault test's survivors: each ~5 s of CPU not spent again); one
        # still busy (blocked in a collective or by an injected fault, mid-unit) is killed, and so is
        # every worker of a run that scored beside its units (a score call may still be running in
        # the scoring thread while the default one empties the worker).
        if clean or not pids:
            back = _retired(actors, RETIRE_TIMEOUT_S)
        else:
            back = set() if self.scoring else _retired(actors, FAILED_RETIRE_TIMEOUT_S)
        # keep those back empty, as they started; the rest go
        stay = [i for i, name in enumerate(self.names) if name in back]
        self.pool.keep(
            [
                Kept(self.names[i], self.kinds[i], self.groups[i], actors[self.names[i]], self.keys[i])
                for i in stay
            ]
        )
        self.pool.forget([key for i, key in enumerate(self.keys) if i not in stay])
        taken = [k.actor for k in self.kept if k is not None and k.actor not in actors.values()]
        for actor in [*(a for name, a in actors.items() if name not in back), *taken]:
            ray.kill(actor, no_restart=True)
        for i, group in enumerate(self.groups):
            if i not in stay:
                remove_placement_group(group)


def _retired(actors: dict, timeout: float) -> set[str]:
    """Empty every worker of a run for the next one: the names of those that came back empty within
    ``timeout`` in the process they started the run in (a process Ray restarted answers None)."""
    import ray

    calls = {name: a.retire.remote() for name, a in actors.items()}
    ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout)
    back = set()
    for name, call in calls.items():
        try:
            if ray.get(call, timeout=0) is not None:
                back.add(name)
        except Exception:  # noqa: BLE001 -- a worker that cannot retire (or not yet) is killed
            pass
    return back
