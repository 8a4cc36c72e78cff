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

Fresh actors, always, where a kept process could carry something over: a run with injected faults
(``engine.faults``: Ray restarts a lost actor with its first run's arguments) or a compiled
transformer (dynamo's caches); a run that failed, or whose actors were restarted or did not come
back empty, is torn down as without warm workers.
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


class WarmPool:
    """The actors kept by this process's finished runs, and what they saved (``reused``/``started``)."""

    def __init__(self):
        self.kept: list[Kept] = []
        self.reused = self.started = 0

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


def eligible(cfg) -> bool:
    """Whether a run may use (and leave) warm actors (module docstring)."""
    return not cfg.engine.faults and cfg.engine.compile_rollout != "on"


def kind_of(bundle: dict, scoring: bool, max_restarts: int) -> tuple:
    """What an actor is created with and a rebuild cannot change: its device resources (its
    bundle without the CPU share), the scoring concurrency group, its restart budget."""
    return (tuple(sorted((k, v) for k, v in bundle.items() if k != "CPU")), scoring, max_restarts)


def bundle_of(kind: tuple) -> dict:
    """The one-bundle reservation of a warm actor of ``kind``."""
    return {"CPU": CPU_SHARE, **dict(kind[0])}
