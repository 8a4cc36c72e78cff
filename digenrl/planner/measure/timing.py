"""Timing calls on one device: warm-up phase by phase (peak memory per phase, batches that do not
fit dropped), then every call timed in round robin.

Details: docs/modules.md, `digenrl.planner.measure.timing`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch

from digenrl.planner.constants import MAX_TIMING_ROUNDS, TIMING_BUDGET_MIN_TIMES


def peak_rss() -> int:
    """This process's peak resident memory in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's intra-op thread count set to ``n`` inside the block (unchanged for None)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RoundRobin:
    """Named calls to time on ``device``: :meth:`add` warms one up, :meth:`phase` records the peak
    memory of the calls added inside it, :meth:`means` times them all in round robin."""

    def __init__(self, device: torch.device, warmup: int):
        self.device, self.warmup = device, warmup
        self.items: dict[str, Callable[[], object]] = {}
        self.skipped: dict[str, list[int]] = {"rollout": [], "train": []}  # batches that ran out of memory
        self.peaks: dict[str, int] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        """The peak memory of what runs inside: CUDA ``max_memory_allocated``, or the peak RSS on CPU."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        self.peaks[name] = (
            torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else peak_rss()
        )

    def add(self, name: str, fn: Callable[[], object], phase: str) -> bool:
        """Warm ``fn`` up and keep it for timing; False (and the batch noted as skipped) when a
        ``name`` of the form ``kind:batch`` runs out of device memory."""
        try:
            for _ in range(max(1, self.warmup)):
                fn()
                self.sync()
        except torch.cuda.OutOfMemoryError:
            self.skipped[phase].append(int(name.rsplit(":", 1)[1]))
            torch.cuda.empty_cache()
            return False
        self.items[name] = fn
        return True

    def has(self, kind: str) -> bool:
        return any(k.startswith(f"{kind}:") for k in self.items)

    def rounds(self, repeats: int, min_time: float) -> dict[str, list[float]]:
        """Seconds per call of every item, round after round: at least ``repeats`` rounds and
        ``TIMING_BUDGET_MIN_TIMES x min_time`` seconds, at most ``MAX_TIMING_ROUNDS`` once ``repeats`` is
        met."""
        timed: dict[str, list[float]] = {name: [] for name in self.items}
        budget = TIMING_BUDGET_MIN_TIMES * min_time
        started = time.perf_counter()
        while True:
            for name, fn in self.items.items():
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                timed[name].append(time.perf_counter() - t0)
            done = len(next(iter(timed.values())))
            if done >= repeats and (time.perf_counter() - started >= budget or done >= MAX_TIMING_ROUNDS):
                return timed


def means(timed: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.fmean(v) for name, v in timed.items()}
