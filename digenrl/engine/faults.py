"""Fault injection (``engine.faults``): a plugin in each engine process that can die.

Details: docs/modules.md, `digenrl.engine.faults`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from digenrl.config.engine import FaultConfig
from digenrl.errors import UserError

ENV = "DIGENRL_FAULTS"


def fault_plan(cfg) -> set[tuple[str, str]]:
    """``engine.faults`` plus ``DIGENRL_FAULTS=worker@unit,worker@unit`` (tests, soak runs)."""
    plan = {(f.worker, f.unit) for f in cfg.engine.faults}
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        worker, sep, unit = item.strip().partition("@")
        if not sep or not worker or not unit:
            raise UserError(f"{ENV}: expected worker@unit (e.g. rollout0@rollout-1-0), got {item!r}")
        plan.add((worker, unit))
    return plan


def with_fault_plan(cfg):
    """``cfg`` whose ``engine.faults`` is the whole plan (the environment's faults included): what the
    engine hands its processes, which may not see the driver's environment."""

    faults = [FaultConfig(worker=w, unit=u) for w, u in sorted(fault_plan(cfg))]
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"faults": faults})})


class FaultInjector:
    """The faults of one named process."""

    def __init__(self, name: str, units: frozenset[str]):
        self.name, self.units = name, units

    @classmethod
    def from_config(cls, cfg, name: str) -> FaultInjector:
        return cls(name, frozenset(f.unit for f in cfg.engine.faults if f.worker == name))

    def reached(self, uid: str | None) -> None:
        """This process has done unit ``uid``'s work: die here if a fault says so, with
        ``<uid>:block`` block here for good (a hung member: alive, never returning), with
        ``<uid>:stop`` stop the whole process (SIGSTOP: it neither raises nor answers, as a hung NCCL
        peer), with ``<uid>:drop`` raise ConnectionError (a connection that broke: the process lives
        on); once."""
        for suffix, how in {"": "dies", ":block": "blocks", ":stop": "stops", ":drop": "drops"}.items():
            fault = f"{uid}{suffix}"
            if fault not in self.units:
                continue
            mark = _mark(_incarnations(), f"{self.name}-{fault}")
            if mark.exists():  # fired already, in an earlier process of this actor
                continue
            mark.touch()
            print(f"fault injection: {self.name} {how} in {uid} at {time.time():.3f}", file=sys.stderr)
            sys.stderr.flush()
            if how == "drops":
                raise ConnectionError(f"fault injection: {self.name}'s connection dropped in {uid}")
            if how == "stops":  # until killed (SIGKILL ends a stopped process)
                os.kill(os.getpid(), signal.SIGSTOP)
            while how in ("blocks", "stops"):
                time.sleep(3600)
            os._exit(17)

    def corrupts(self, version: int):
        """The wrapper that corrupts this process's broadcast of ``version``, or None."""
        return corrupting if f"sync-{version}" in self.units else None


@contextlib.contextmanager
def corrupting(group, bucket: int = 0, element: int = 0):
    """Within the block, weight bucket ``bucket`` that ``group`` broadcasts arrives with one bit of
    byte ``element`` flipped (the source's own tensors are untouched). A version's broadcasts:
    header size, header, buckets."""
    real, calls = group.broadcast, [0]

    def broadcast(tensor, src):
        calls[0] += 1
        if calls[0] == 3 + bucket:
            tensor = tensor.clone()
            tensor[element] ^= 1
        real(tensor, src)

    group.broadcast = broadcast
    try:
        yield group
    finally:
        group.broadcast = real


def _mark(incarnation: str, what: str) -> Path:
    """Where a process marks a fault it fired, so that Ray's restart of it does not fire it again:
    this node's temp directory (``what``: ``*`` for every mark of ``incarnation``)."""
    return Path(tempfile.gettempdir()) / f"digenrl-fault-{incarnation}-{what}"


def forget_fired(incarnations) -> None:
    """The run is over: its processes' marks go (those on this node), so no file is left behind and
    a process kept for another run (the test suite's warm actors) fires that run's faults anew."""
    for incarnation in incarnations:
        pattern = _mark(incarnation, "*")
        for mark in pattern.parent.glob(pattern.name):
            mark.unlink(missing_ok=True)


def _incarnations() -> str:
    """What a process shares with its restarted successors: the Ray actor's id (outside an actor,
    the process id)."""
    try:
        import ray

        if ray.is_initialized():
            actor = ray.get_runtime_context().get_actor_id()
            if actor:
                return actor
    except Exception:  # noqa: BLE001  (no Ray here: a plain process)
        pass
    return str(os.getpid())
