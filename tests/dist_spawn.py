"""Run a function on N gloo ranks (fresh processes forked from a server that imported torch, diffusers
and digenrl once), for the multi-process tests."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: What the ranks' forkserver imports once, before it forks them: each rank then starts in ~0.1 s
#: instead of spending ~4 s of CPU importing torch, diffusers, peft and digenrl (a spawned process).
PRELOAD = [
    "torch",
    "torch.distributed",
    "diffusers",
    "peft",
    "digenrl.policy.model",
    "digenrl.distributed.fsdp",
    "digenrl.distributed.dcp",
    "digenrl.distributed.broadcast",
    "digenrl.distributed.sequence_parallel",
    "digenrl.units.rollout",
    "digenrl.units.train",
]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RAY_AUTH_MODE="disabled")
    torch.set_num_threads(1)
    if world > 0:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, max(world, 1), *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: A rank that waits in a mismatched collective sleeps in the kernel: no CPU for this long is a hang.
IDLE_S = 60.0
#: However busy the machine: ranks that still compute after this long are stopped too.
LIMIT_S = 1800.0


def cpu_seconds(pids: list[int]) -> float | None:
    """CPU seconds (user + system) the processes ``pids`` have used so far; None without /proc."""
    if not os.path.isdir("/proc"):
        return None
    ticks, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # that rank is done and gone
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def spawn(fn, world: int, *args, nprocs: int | None = None, idle_s: float = IDLE_S) -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` new processes joined in one gloo group
    (``world=0``: ``nprocs`` processes without a default group); raises if any rank raises or the
    ranks hang (a collective mismatch waits forever: it never passes). A hang is told by the ranks'
    CPU time, not by the clock: ranks that used under 1/60 of ``idle_s`` in CPU seconds (1 s of 60)
    in ``idle_s`` seconds are waiting, while on a loaded machine slow ranks still compute (a
    wall-clock deadline failed there; so did a fixed 1 s of CPU in a 2 s window at load 13)."""
    ctx = mp.start_processes(
        _entry,
        args=(fn, world, free_port(), args),
        nprocs=nprocs or world,
        join=False,
        start_method="forkserver",
    )
    pids = [p.pid for p in ctx.processes]
    start = last_busy = time.monotonic()
    used = cpu_seconds(pids) or 0.0
    while not ctx.join(timeout=1.0):
        now, cpu = time.monotonic(), cpu_seconds(pids)
        if cpu is None or cpu > used + idle_s / 60:  # (no /proc: only the overall limit applies)
            last_busy, used = now, cpu if cpu is not None else used
        hung = now - last_busy > idle_s
        if hung or now - start > LIMIT_S:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            what = f"idle (no CPU) for {idle_s:.0f} s" if hung else f"not done after {LIMIT_S:.0f} s"
            raise TimeoutError(f"ranks {what}")
