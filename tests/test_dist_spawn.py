"""tests/dist_spawn.py tells a hang from a slow rank by the ranks' CPU time, not by the clock."""

from __future__ import annotations

import time

import pytest

from tests.dist_spawn import spawn

pytestmark = pytest.mark.slow  # starts processes


def _wait(rank, world):
    time.sleep(600)  # as a rank in a mismatched collective: asleep, no CPU


def _compute(rank, world, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # busy all along: slow, not hung
        sum(range(1000))


def test_a_waiting_rank_is_a_hang_a_computing_one_is_not():
    with pytest.raises(TimeoutError, match="idle"):
        spawn(_wait, 0, nprocs=1, idle_s=2)
    spawn(_compute, 0, 4.5, nprocs=1, idle_s=2)  # longer than idle_s, and it passes
