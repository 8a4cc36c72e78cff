"""The units of work the scheduler (:mod:`digenrl.schedule.scheduler`) hands out -- rollout, train
and step units -- and the worker spec it hands them to: the records the driver, the Ray runtime,
the simulator and the timeline pass around. Plain frozen dataclasses, no behaviour beyond naming
a unit's samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["rollout", "trainer", "both"]


@dataclass(frozen=True)
class WorkerSpec:
    """What the policy knows of a worker (:class:`digenrl.placement.plan.Worker` adds its pool)."""

    name: str
    role: Role  # "both": a colocated device that rolls out and is a trainer rank


@dataclass(frozen=True)
class RolloutUnit:
    uid: str
    iteration: int
    index: int  # position within the iteration
    groups: tuple[int, ...]  # global group ids within the iteration
    version: int  # policy version to generate with (the newest one at hand-out; a part: its group's)
    part: int = 0  # sub-group units: which part of its one group (samples part*G/parts .. (part+1)*G/parts)
    parts: int = 1  # 1: whole groups

    def sample_range(self, group_size: int) -> tuple[int, int]:
        """The samples of each of its groups this unit generates: [lo, hi) of 0..group_size."""
        n = group_size // self.parts
        return self.part * n, (self.part + 1) * n


@dataclass(frozen=True)
class TrainUnit:
    uid: str
    iteration: int
    rollout_uid: str  # the rollout unit whose samples this trains
    groups: tuple[int, ...]
    sample_version: int  # version the samples were generated with
    tsp_rank: int  # trains trained-timestep positions j with j % tsp_degree == tsp_rank
    tsp_degree: int
    version: int  # trainer weights version (== iteration)
    step: int = 0  # mini-batch s: the s-th slice of each group's samples, for the iteration's step s


@dataclass(frozen=True)
class StepUnit:
    """One trainer rank's share of the collective all-reduce + optimizer step ``step`` of iteration k.

    Every rank gets its own StepUnit (uid ``step-<k>/<worker>``, with several optimizer steps per
    iteration ``step-<k>.<s>/<worker>``); ``version`` is the version the rank holds after it: k + 1
    after the iteration's ``last`` step (which publishes it), k after an intermediate one.
    """

    uid: str
    iteration: int
    version: int
    step: int = 0
    last: bool = True


Unit = RolloutUnit | TrainUnit | StepUnit
