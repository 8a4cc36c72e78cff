"""What the simulator (:mod:`~digenrl.planner.simulator`) advances in virtual time: a job -- one unit on
one worker -- as a list of segments (the driver's call, waiting for samples, a collective wait, a phase
switch, the timeline events it records), each with its seconds at full speed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Seg:
    kind: str  # "call" | "samples" (waiting for them) | "wait" (collective) | "switch" | a timeline kind
    amount: float  # seconds at full speed (inf: until released)
    cpu: bool  # competes for host cores (cpu pools)
    event: dict | None = None  # timeline event fields, recorded when the segment ends
    start: float = 0.0


@dataclass
class Job:
    seq: int
    worker: str
    unit: object
    segs: list[Seg]
    i: int = 0
    remaining: float = 0.0
    arrived: float = 0.0  # step: when the rank reached the collective

    @property
    def seg(self) -> Seg:
        return self.segs[self.i]
