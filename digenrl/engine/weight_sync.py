"""Weight sync from trainer rank 0 to the rollout workers, through the Ray object store.

After each optimizer step rank 0 *publishes* the new weights once (``ray.put`` of
``Policy.weights()``: the LoRA tensors only when training LoRA) as a small :class:`WeightPacket`
holding the version, the checksum, the key list and an object reference. A rollout worker
that is handed a unit of a newer version *fetches* the packet's tensors, *verifies* them and
loads them at the unit boundary, never inside a unit.

Every sync is verified (docs/architecture.md): the shipped keys must be exactly the keys the receiver
expects (a dropped LoRA module would otherwise leave it sampling with stale weights, as peers
have shipped) and the checksum must match before and after the load. Any mismatch raises
:class:`~digenrl.lora.WeightSyncError`.

Each publish / fetch returns a timeline event of kind ``"sync"`` carrying ``bytes`` and its
wall-clock span, so the run's metrics can report ``sync_s`` and ``sync_bytes``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from digenrl.lora import WeightSyncError, checksum


@dataclass(frozen=True)
class WeightPacket:
    """What travels through the driver: small metadata plus a reference to the tensors.

    The reference is nested inside this object so Ray does not resolve it on the way into a
    worker call: the worker fetches it itself, only when it needs that version, and times it.
    """

    version: int
    checksum: str
    keys: tuple[str, ...]
    nbytes: int
    ref: Any  # ray.ObjectRef of dict[str, Tensor] (or the dict itself, without Ray)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sync_event(version: int, iteration: int, direction: str, start: float, end: float, nbytes: int) -> dict:
    """A timeline event. A publish belongs to the iteration whose step made the version, a
    fetch to the iteration of the rollout unit it precedes (where its time is spent)."""
    return {
        "kind": "sync",
        "uid": f"sync-{version}-{direction}",
        "iteration": iteration,
        "version": version,
        "start": start,
        "end": end,
        "args": {"direction": direction, "bytes": nbytes},
    }


def publish(policy, put=None) -> tuple[WeightPacket, dict]:
    """Ship the policy's current weights once; returns the packet and its sync event."""
    if put is None:
        import ray

        put = ray.put
    start = time.time()
    state = policy.weights()
    packet = WeightPacket(
        version=policy.version,
        checksum=checksum(state),
        keys=tuple(sorted(state)),
        nbytes=state_bytes(state),
        ref=put(state),
    )
    return packet, sync_event(packet.version, packet.version - 1, "publish", start, time.time(), packet.nbytes)


def fetch(packet: WeightPacket, get=None) -> dict[str, torch.Tensor]:
    if get is None:
        import ray

        get = ray.get
    return get(packet.ref)


def verify(state: dict[str, torch.Tensor], packet: WeightPacket, expected_keys) -> None:
    """All expected keys present, none unexpected, checksum equal to the published one."""
    expected, got = set(expected_keys), set(state)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise WeightSyncError(
            f"weight sync of version {packet.version}: {len(missing)} missing keys {missing[:3]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:3]}"
        )
    if set(packet.keys) != got:
        raise WeightSyncError(f"weight sync of version {packet.version}: keys differ from the published list")
    digest = checksum(state)
    if digest != packet.checksum:
        raise WeightSyncError(
            f"weight sync of version {packet.version}: checksum {digest[:12]} != published {packet.checksum[:12]}"
        )


def load(policy, packet: WeightPacket, expected_keys, iteration: int, get=None) -> dict:
    """Fetch, verify and load a packet into ``policy`` (which re-checks the checksum after the
    load) before a rollout unit of ``iteration``; returns the sync event."""
    start = time.time()
    state = fetch(packet, get)
    verify(state, packet, expected_keys)
    policy.load_weights(state, packet.version, expected_checksum=packet.checksum)
    return sync_event(packet.version, iteration, "fetch", start, time.time(), packet.nbytes)
