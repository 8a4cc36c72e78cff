"""CPU contention: what other processes on the host do while we measure (:class:`OtherLoad`, a
/proc sampler), and how much slower a worker gets beside concurrent workers (:func:`cpu_slowdown`,
a forked probe)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from digenrl.planner.constants import (
    MAX_ANCESTRY,
    NICE_WEIGHT_BASE,
    OTHER_LOAD_EVERY_S,
    SHARING_JOIN_S,
    SHARING_MIN_SECONDS,
    SHARING_SLOT_S,
    SHARING_START_PER_WORKER_S,
    SHARING_START_S,
    SHARING_TIMEOUT_PER_SECOND,
    SHARING_TIMEOUT_S,
)


class OtherLoad:
    """What processes that are not ours (other users of a shared host) do while a block runs: a
    thread samples /proc every ``every`` seconds. ``other_runnable``: the mean number of their
    threads that were runnable, weighted by priority (a nice-0 thread counts 1) -- the demand our
    workers share the cores with; ``other_cores``: the CPU time they got per second. A process is
    ours when this process is among its ancestors (a Ray cluster it started, the engine's workers,
    the forked sharing probe). Reads 0 where there is no /proc."""

    def __init__(self, every: float = OTHER_LOAD_EVERY_S):
        import threading

        self.every, self.me = every, os.getpid()
        self.other = self.ours = 0.0
        self.seconds = 0.0
        self.runnable: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _snapshot() -> dict[int, tuple[int, float]]:
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return out

    def _is_ours(self, pid: int, snap: dict) -> bool:
        seen = 0
        while pid > 1 and seen < MAX_ANCESTRY:
            if pid == self.me:
                return True
            pid = snap.get(pid, (0, 0.0))[0]
            seen += 1
        return False

    @staticmethod
    def _running(pid: int) -> float:
        """Runnable threads of ``pid``, each weighted as the kernel's fair scheduler weighs it against
        a nice-0 thread (``NICE_WEIGHT_BASE ** -nice``: Ray starts its workers at nice 15, so another
        user's idle-priority Ray workers barely take anything from ours)."""
        n = 0.0
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return 0.0
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "R":
                n += NICE_WEIGHT_BASE ** -int(fields[16])
        return n

    def _run(self) -> None:
        last, t_last = self._snapshot(), time.perf_counter()
        while not self._stop.wait(self.every):
            snap, now = self._snapshot(), time.perf_counter()
            ours = {pid for pid in snap if self._is_ours(pid, snap)}
            if snap:
                self.runnable.append(sum(self._running(pid) for pid in snap if pid not in ours))
            for pid, (_, cpu) in snap.items():
                used = cpu - last[pid][1] if pid in last else 0.0
                if used > 0:
                    if pid in ours:
                        self.ours += used
                    else:
                        self.other += used
            self.seconds += now - t_last
            last, t_last = snap, now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    @property
    def other_cores(self) -> float:
        return self.other / self.seconds if self.seconds else 0.0

    @property
    def other_runnable(self) -> float:
        return statistics.fmean(self.runnable) if self.runnable else 0.0


def private_weights(policy) -> None:
    """In a forked child: give every module of the policy its own copy of its weights (fork shares
    the parent's pages until written; separate engine workers never share them)."""
    for owner in (policy, policy.adapter):
        for obj in vars(owner).values():
            if isinstance(obj, torch.nn.Module):
                for t in [*obj.parameters(), *obj.buffers()]:
                    t.data = t.data.clone()


def _observe(fn, prepare, t0: float, seconds: float, conn) -> None:
    """A forked observer: run ``fn`` back to back from ``t0`` for ``seconds``; report (start, end) per
    call."""
    result = None
    try:
        torch.set_num_threads(1)
        prepare()
        fn()  # warm
        while time.monotonic() < t0:
            time.sleep(0.001)
        calls = []
        while time.monotonic() - t0 < seconds:
            a = time.monotonic()
            fn()
            calls.append((a, time.monotonic()))
        result = calls
    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
        result = f"{type(exc).__name__}: {exc}"
    finally:
        conn.send(result)  # synchronous: written before we exit
        os._exit(0)


def _neighbour(fn, prepare, t0: float, seconds: float, slot: float) -> None:
    """A forked neighbour: from ``t0``, compute (``fn`` back to back) in even slots, sleep in odd ones."""
    try:
        torch.set_num_threads(1)
        prepare()
        fn()  # warm
        took = 0.0
        while (now := time.monotonic()) - t0 < seconds:
            k = (now - t0) // slot if now >= t0 else -1
            if k >= 0 and k % 2 == 0 and t0 + (k + 1) * slot - now > took:  # room for one more call
                a = time.monotonic()
                fn()
                took = time.monotonic() - a
            else:
                time.sleep(0.001)
    finally:
        os._exit(0)


def cpu_slowdown(
    fn: Callable[[], object],
    max_workers: int = 3,
    seconds: float = SHARING_MIN_SECONDS,
    slot: float = SHARING_SLOT_S,
    prepare: Callable[[], object] = lambda: None,
) -> dict[str, float]:
    """How much slower a worker gets when ``n`` worker processes compute at once on this host:
    {n: time per call with n - 1 neighbours computing / time per call alone}. One forked observer
    runs ``fn`` back to back for ``seconds`` while n - 1 forked neighbours compute in every other
    ``slot`` and sleep in between; the ratio compares the observer's calls inside busy slots with
    those inside idle ones. Interleaved at the slot's time scale, slow drift of the host's speed
    (other tenants, frequency) weighs on both sides alike, where measuring n = 1 and n = 2 one after
    the other would not. Each process first runs ``prepare`` (the profile gives it a private copy of
    the model's weights, as every engine worker has: forked copies sharing one set of pages would
    not compete for the caches as engine workers do). On an idle machine with C cores the ratio is
    ~max(1, n / C) times what shared caches and memory bandwidth add; on a shared one it shows what
    is left to us (measured figures: docs/scaling.md)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")

    def once(n: int) -> float:
        recv, send = ctx.Pipe(duplex=False)
        t0 = time.monotonic() + SHARING_START_S + SHARING_START_PER_WORKER_S * n  # all forked and warm
        procs = [ctx.Process(target=_observe, args=(fn, prepare, t0, seconds, send), daemon=True)]
        procs += [
            ctx.Process(target=_neighbour, args=(fn, prepare, t0, seconds, slot), daemon=True)
            for _ in range(n - 1)
        ]
        for p in procs:
            p.start()
        try:
            answered = recv.poll(SHARING_TIMEOUT_S + SHARING_TIMEOUT_PER_SECOND * seconds)
            got = recv.recv() if answered else "no answer within the timeout"
        finally:
            for p in procs:
                p.join(timeout=SHARING_JOIN_S)
                if p.is_alive():
                    p.kill()
        if not isinstance(got, list):
            raise RuntimeError(f"CPU sharing probe failed in a worker: {got}")
        busy, idle = [], []
        for a, b in got:  # calls wholly inside one slot only
            k = (a - t0) // slot
            if k == (b - t0) // slot and k >= 0:
                (busy if k % 2 == 0 else idle).append(b - a)
        if not busy or not idle:
            raise RuntimeError(
                f"CPU sharing probe: a call of {statistics.fmean(b - a for a, b in got):.3f} s "
                f"does not fit in a {slot} s slot"
            )
        return statistics.fmean(busy) / statistics.fmean(idle)

    return {"1": 1.0, **{str(n): once(n) for n in range(2, max_workers + 1)}}
