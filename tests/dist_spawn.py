"""Run a function on N gloo ranks (torch.multiprocessing spawn), for the multi-process tests."""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def spawn(fn, world: int, *args, nprocs: int | None = None, timeout_s: float = 240.0) -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` fresh processes joined in one gloo group
    (``world=0``: ``nprocs`` processes without a default group); raises if any rank raises or
    the ranks are not done within ``timeout_s`` (a collective mismatch hangs, never passes)."""
    ctx = mp.start_processes(
        _entry, args=(fn, world, free_port(), args), nprocs=nprocs or world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"ranks not done after {timeout_s:.0f} s")
