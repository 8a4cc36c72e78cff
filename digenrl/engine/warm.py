"""Warm workers: a process that runs the engine many times keeps its actors between runs.

Starting an engine actor costs ~5 s of CPU before it builds anything (importing torch, Ray and
diffusers' model classes: docs/engine.md "Warm workers"), and a tiny run is over in about one
second. Inside :func:`warm_workers` the end of a run leaves its actors alive and empty
(``EngineWorker.retire``); the next run takes the kept actors of the kinds it needs -- the same
device resource, the same scoring concurrency group, the same restart budget -- and builds its
workers in them (``EngineWorker.rebuild``), starting fresh actors only for the rest; kept actors
it does not take stay kept unless the actors it starts need their devices. The test suite runs
inside it; a single ``digenrl train`` never does.

What changes inside: each warm actor holds its own one-bundle placement group (so one can be kept
and another released) with a small fixed CPU share (so kept and new actors always fit together),
where a run without warm workers reserves all its workers as one placement group.

Ray restarts a lost actor by calling its constructor with the arguments it was created with: for a
kept actor, an earlier run's. So every warm actor is created with a handle to the pool's
:class:`ArgsBoard`, where the driver posts the arguments of the worker it builds in that actor for
each run (:meth:`WarmPool.post`); a restarted warm actor builds what the board says
(``EngineWorker.__init__``'s ``restart_from``). Runs with injected faults use warm actors too.

Fresh actors, always, where a kept process could carry something over: a compiled transformer
(dynamo's caches). After a run that failed, every actor is killed; after one that finished, the
actors that came back empty in the process they started the run in are kept, the others (restarted
ones) killed.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

#: A warm actor's CPU share (logical): small enough that any run's workers fit beside kept ones.
CPU_SHARE = 0.05

_active: WarmPool | None = None  # the pool of the warm_workers() block this process is in


@dataclass
class Kept:
    name: str  # the worker it ran last (it is only ever that worker again: see WarmPool.take)
    kind: tuple  # what fixes an actor at creation (see kind_of)
    group: object  # its one-bundle placement group
    actor: object
    key: str = ""  # its entry on the pool's ArgsBoard


class ArgsBoard:
    """A Ray actor of the pool: by warm actor, the constructor arguments of the worker last built in it
    (a one-element list holding the driver's ObjectRef of ``(args, kwargs)``: never unpickled here)."""

    def __init__(self):
        self.posted: dict[str, list] = {}

    def put(self, key: str, boxed: list) -> None:
        self.posted[key] = boxed

    def get(self, key: str) -> list:
        return self.posted[key]

    def drop(self, keys: list[str]) -> None:
        for key in keys:
            self.posted.pop(key, None)


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
        """For each of a run's workers (``names``, ``kinds``, in order), the kept actor that last ran
        the worker of that name, when of that kind (handed over: no longer kept), or None. The kept
        actors not taken stay kept unless the workers to start need their devices (of the cluster's
        ``total``): those are released.

        By name: a worker comes back as itself. (What torch keeps per process across runs, DTensor's
        sharding cache, ``EngineWorker.retire`` clears: :func:`digenrl.distributed.fsdp.forget_meshes`.)"""
        left, out = list(self.kept), []
        for name, kind in zip(names, kinds):
            match = next((k for k in left if k.name == name and k.kind == kind), None)
            if match is not None:
                left.remove(match)
            out.append(match)
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


def kind_of(bundle: dict, scoring: bool, max_restarts: int) -> tuple:
    """What an actor is created with and a rebuild cannot change: its device resources (its
    bundle without the CPU share), the scoring concurrency group, its restart budget."""
    return (tuple(sorted((k, v) for k, v in bundle.items() if k != "CPU")), scoring, max_restarts)


def bundle_of(kind: tuple) -> dict:
    """The one-bundle reservation of a warm actor of ``kind``."""
    return {"CPU": CPU_SHARE, **dict(kind[0])}
