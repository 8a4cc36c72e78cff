"""What every peer model (:mod:`~digenrl.planner.peers`, :mod:`~digenrl.planner.peer_verl_omni`) shares:
the predicted iteration (:class:`PeerRun`) and the per-call, copy and collective times it is summed from
-- the same per-call times as DigenRL's units (:mod:`~digenrl.planner.call_times`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from digenrl.placement.devices import DEVICES
from digenrl.planner.call_times import AnalyticTimes, CallTimes, ProfiledTimes


@dataclass
class PeerRun:
    """One peer's predicted iteration: seconds per phase (in order), per iteration."""

    name: str
    where: str  # e.g. "4xH800" or "R 1xH800 / T 3xH800"
    phases: dict[str, float] = field(default_factory=dict)
    iteration_s: float = 0.0
    samples: int = 0
    devices: int = 0
    why_not: str = ""  # non-empty: the peer cannot run this model on this cluster

    @property
    def fits(self) -> bool:
        return not self.why_not

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.iteration_s if self.iteration_s else 0.0

    @property
    def per_device_s(self) -> float:
        return self.samples_per_s / self.devices if self.devices else 0.0


def times(
    cost, device: str, checkpointing: bool = False, cfg_batched: bool = True, fused: bool = False
) -> CallTimes:
    """Per-call times of one unsharded device (a profile's when it measured this type); ``fused``: a
    serving engine's transformer (op_counts.SERVED_FUSED)."""
    if cost.profiled(device):
        return ProfiledTimes(cost.profile)
    return AnalyticTimes(
        cost.workload,
        DEVICES[device],
        cost.params,
        checkpointing=checkpointing,
        cfg_batched=cfg_batched,
        fused=fused,
    )


def host_s(cost, device: str, nbytes: float) -> float:
    """A pinned host <-> device copy of ``nbytes``."""
    return nbytes / (DEVICES[device].host_bw * cost.params.host_bw_efficiency)


def collective_s(cost, device: str, ranks: int, nbytes: float) -> float:
    """An all-gather (or reduce-scatter) of ``nbytes`` over ``ranks`` devices: (r-1)/r of it per device."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / cost.link_bw(device, ranks)


def unhidden(cost, collective: float, compute: float) -> float:
    """What a prefetched collective adds to a call: the share ``fsdp_overlap`` of it hides behind
    the call's compute, never more than the compute itself."""
    return collective - min(cost.params.fsdp_overlap * collective, compute)


def batches(samples: float, batch: int) -> tuple[int, float]:
    """``samples`` in the fewest calls of at most ``batch``: (calls, samples per call)."""
    if samples <= 0:
        return 0, 0.0
    calls = max(1, math.ceil(samples / batch - 1e-9))
    return calls, samples / calls


def one_type(cluster) -> tuple[str, int] | None:
    """(device type, count) of a cluster of one type; None for a mixed cluster."""
    devices = cluster.devices
    return next(iter(devices.items())) if len(devices) == 1 else None


def weights_fit(cost, device: str, nbytes: float) -> bool:
    return nbytes <= DEVICES[device].memory * cost.params.usable_memory
