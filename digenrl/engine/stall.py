"""The driver's check for a stalled process (``engine.stall_timeout_s``): while a worker has a call in
flight, the driver pings it and the followers that run the call with it (``alive()``, in each actor's
``health`` concurrency group, so a member inside a collective answers). A member that gives no answer
from the process it first answered from for ``stall_timeout_s`` -- stopped, dead, or restarted under
its waiting lead -- is stalled: the driver takes its group down (:class:`~digenrl.engine.recovery.
GroupRestart`), so a peer waiting in a collective (NCCL never raises) is not waited on for
``engine.group_timeout_s``. Details: docs/engine.md, "Faults"."""

from __future__ import annotations

import sys
import time

#: the actor's concurrency group of ``alive()``: answered beside whatever the worker runs
HEALTH_GROUP = "health"
PING_EVERY_S = 1.0  # how often a busy member is asked again once it answered


class GroupStalled(RuntimeError):
    """A member of a busy worker's group stopped answering: the driver took the group down."""


class StallWatch:
    """The driver's pings of busy workers' members, and who stopped answering them."""

    def __init__(self, actors: dict, members: dict[str, list[str]], timeout_s: float):
        """``members``: each scheduled worker -> the processes its calls run on (itself first, then
        the followers it leads); ``timeout_s``: ``engine.stall_timeout_s``."""
        self.actors, self.members, self.timeout_s = actors, members, timeout_s
        self.pings: dict[str, object] = {}  # member -> its ping in flight (an ObjectRef)
        self.since: dict[str, float] = {}  # member of a busy worker -> its last answer (or the call's start)
        self.pid: dict[str, int] = {}  # member of a busy worker -> the process that answers for it
        self.down: set[str] = set()  # busy workers taken down (once: their calls fail as deaths)

    @classmethod
    def of(cls, layout, actors: dict, timeout_s: float) -> StallWatch:
        """The watch of a run's ``layout``: each scheduled worker with the followers it leads."""
        members = {w.name: [w.name, *layout.followers_of(w.name)] for w in layout.scheduled}
        return cls(actors, members, timeout_s)

    def check(self, busy: set[str]) -> dict[str, str]:
        """Ping the members of the ``busy`` workers (those with a call in flight); the busy workers
        with a member stalled for ``timeout_s``, each with a line naming it (taken down once)."""
        now = time.time()
        self.down &= busy
        watched = {m: w for w in busy - self.down for m in self.members.get(w, ())}
        for m in set(self.since) - set(watched):  # no call in flight: a next one starts afresh
            self.since.pop(m)
            self.pid.pop(m, None)
        self._answers(watched, now)
        stalled: dict[str, str] = {}
        for m, worker in watched.items():
            quiet = now - self.since.setdefault(m, now)
            if quiet > self.timeout_s and worker not in stalled:
                stalled[worker] = (
                    f"{m} gave no answer for {quiet:.0f} s (engine.stall_timeout_s: {self.timeout_s:g}) "
                    f"while {worker} ran a call with it"
                )
            elif m not in self.pings and now - self.since[m] >= min(PING_EVERY_S, self.timeout_s / 4):
                call = self.actors[m].alive.options(concurrency_group=HEALTH_GROUP)
                self.pings[m] = call.remote()
        for worker, line in stalled.items():
            print(f"warning: {line}: a stalled member; taking the group down", file=sys.stderr)
            self.down.add(worker)
        return stalled

    def _answers(self, watched: dict[str, str], now: float) -> None:
        """Read the pings answered: an answer from the member's first process counts (``since``);
        an error (dead, restarting) or another process (restarted under its lead) does not."""
        import ray

        if not self.pings:
            return
        done = set(ray.wait(list(self.pings.values()), num_returns=len(self.pings), timeout=0)[0])
        for m, ref in list(self.pings.items()):
            if ref not in done:
                continue
            del self.pings[m]
            try:
                pid = ray.get(ref)
            except Exception:  # noqa: BLE001  (a dead or restarting process: no answer)
                continue
            if m in watched and self.pid.setdefault(m, pid) == pid:
                self.since[m] = now
