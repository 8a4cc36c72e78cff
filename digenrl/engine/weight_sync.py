"""Weight sync from trainer rank 0 to the rollout workers, through the Ray object store.

Details: docs/modules.md, `digenrl.engine.weight_sync`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from digenrl.distributed.broadcast import close_group
from digenrl.distributed.staged import Received
from digenrl.engine.sync_group import load_staged
from digenrl.errors import WeightSyncError
from digenrl.policy.lora import checksum


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
        "args": {"direction": direction, "bytes": nbytes, "transport": "object_store"},
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
    return packet, sync_event(
        packet.version, packet.version - 1, "publish", start, time.time(), packet.nbytes
    )


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
            f"weight sync of version {packet.version}: checksum {digest[:12]} != published "
            f"{packet.checksum[:12]}"
        )


def load(policy, packet: WeightPacket, expected_keys, iteration: int, get=None) -> dict:
    """Fetch, verify and load a packet into ``policy`` (which re-checks the checksum after the
    load) before a rollout unit of ``iteration``; returns the sync event."""
    start = time.time()
    state = fetch(packet, get)
    verify(state, packet, expected_keys)
    policy.load_weights(state, packet.version, expected_checksum=packet.checksum)
    return sync_event(packet.version, iteration, "fetch", start, time.time(), packet.nbytes)


def publish_version(
    policy, sync, transport: str, faults, name: str
) -> tuple[WeightPacket | None, list[dict], bool]:
    """Rank 0 after an iteration's last step: broadcast the new version over ``sync`` (its
    publisher), or put it in the object store. Returns (packet, events, whether the broadcast
    failed -- a rollout worker gone: the driver falls back to the object store)."""
    if transport == "broadcast":
        try:
            return None, [sync.publish(policy, faults.corrupts(policy.version))], False
        except Exception as exc:  # noqa: BLE001
            print(f"warning: {name}: broadcast of version {policy.version} failed ({exc!r})", file=sys.stderr)
            return None, [], True
    if sync is not None:  # the driver has switched to the object store
        sync.close()
    packet, event = publish(policy)
    return packet, [event], False


def load_version(policy, version: int, iteration: int, packet, inbox, expected_keys) -> dict:
    """Before a rollout unit of ``version``: from the packet the unit carries (object store: a
    :class:`WeightPacket`, or a staged version handed on by another worker), else from the
    broadcast inbox."""
    if packet is not None:
        if packet.version != version:
            raise RuntimeError(f"weights of version {packet.version} came with a unit of version {version}")
        if isinstance(packet, Received):  # a staged version handed on through the object store
            return load_staged(policy, packet, iteration, transport="object_store")
        return load(policy, packet, expected_keys, iteration)
    if inbox is None:
        raise RuntimeError(f"no weights of version {version} for this unit")
    return load_staged(policy, inbox.take(version), iteration)


class SyncRoutes:
    """The driver's side: which transport each publish uses and which weights each rollout call
    carries (a packet, an ObjectRef that resolves to one before the call runs, or None when the
    worker's broadcast inbox has the version)."""

    def __init__(self, transport: str, members, start_version: int, actors: dict, rank0: str, store=None):
        self.transport, self.members, self.start = transport, set(members), start_version
        self.store = store  # (host, port) of the group's store: the driver takes the group down through it
        self.broadcast = (
            transport == "broadcast"
        )  # the run began over the group (it may have fallen back since)
        self.actors, self.rank0 = actors, rank0
        self.packets: dict[int, Any] = {}  # version -> WeightPacket / Received, or an ObjectRef of one
        self.held: dict[str, int] = {}  # rollout worker -> version it holds after the calls handed to it
        self.publishing: int | None = None  # the version rank 0's started last step makes
        self.reform = None  # () -> (transport, members): form the group again (cluster.form_sync_group)
        self.rejoined_at: int | None = None  # the re-formed group carries this version and every later one
        self.restarted: set[str] = set()  # members that joined a re-formed group after a restart

    def begin(self) -> None:
        """Object store: rank 0's packet of the starting weights (for a re-queued unit of that
        version on a worker that has moved on; over broadcast each worker keeps its own)."""
        import ray

        if self.transport == "object_store":
            self.packets[self.start] = ray.get(self.actors[self.rank0].publish.remote())

    def step_arg(self, unit) -> str:
        """What rank 0's publishing step is told: the transport of this version."""
        self.publishing = unit.version
        return self.transport

    def stepped(self, unit, result: dict, published: int) -> None:
        """Rank 0's step result: its packet (object store), or a broken broadcast."""
        self.publishing = None
        if result["packet"] is not None:
            self.packets[unit.version] = result["packet"]
        if result.get("sync_failed"):
            self.retire(unit.version, f"trainer rank 0 could not broadcast version {unit.version}")

    def for_rollout(self, worker: str, unit, published: int):
        """The weights a rollout call on ``worker`` carries for ``unit``."""
        had = self.held.get(worker, self.start)
        self.held[worker] = unit.version
        packet = self.packets.get(unit.version)
        since = self.rejoined_at  # (not after a later fallback: the re-formed group may have broken)
        regrouped = self.transport == "broadcast" and since is not None and unit.version >= since
        if regrouped and worker in self.members and had != unit.version:
            return None  # received over the re-formed group (the version rank 0 sent again, or a later one)
        if packet is not None or self.broadcast is False or had == unit.version:
            return packet  # (over the object store from the start, rank 0 published every version)
        if worker in self.members and worker not in self.restarted:
            return None  # its inbox has it (or, after a fallback, says which version it lacks)
        return self._request(unit.version, published)

    def rejoin(self, worker: str):
        """Restarted rollout worker ``worker`` is back: form the group again with every rollout worker
        (each member waits for its running call to end; the old group is closed, staged versions
        carry over) and have trainer rank 0 send the version it holds over it once, so the worker's
        next unit loads the newest weights by broadcast, fingerprints checked. Returns rank 0's
        publish event, or None when the run stays on the object store."""
        import ray

        if not self.broadcast or self.reform is None or worker in self.members:
            return None
        try:
            transport, members, store = self.reform()
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError) as exc:
            # another member died meanwhile (it may not be reported yet): its own return tries again
            print(
                f"warning: weight sync: the group did not re-form with {worker} (a member is away: "
                f"{str(exc).splitlines()[0][:120]}); the object store carries on",
                file=sys.stderr,
            )
            return None
        if transport != "broadcast":
            return None
        self.store = store
        sent = ray.get(self.actors[self.rank0].republish.remote())
        self.restarted |= set(members) - self.members  # back from restarts: no version before the regroup
        self.transport, self.members = "broadcast", set(members)
        self.rejoined_at = sent["version"] + (sent["event"] is None)  # else the next version on
        print(
            f"warning: weight sync: {worker} rejoined; the group re-formed over {len(members)} rollout "
            f"workers, back to broadcast from version {self.rejoined_at}",
            file=sys.stderr,
        )
        return sent["event"]

    def _request(self, version: int, published: int):
        """An object-store copy of ``version`` for a worker outside the group: rank 0's weights if it
        still holds that version, else the copy rank 0 kept of what it broadcast."""
        holds = self.publishing if self.publishing is not None else published
        rank0 = self.actors[self.rank0]
        ref = rank0.publish.remote() if version == holds else rank0.export_staged.remote(version)
        self.packets[version] = ref
        return ref

    def worker_died(self, worker: str, published: int) -> None:
        """A dead rollout worker restarts with the starting weights, outside the group: the rest of
        the run goes through the object store."""
        self.held[worker] = self.start
        self.restarted.discard(worker)
        if worker in self.members:
            self.members.discard(worker)
            self.retire(self.publishing if self.publishing is not None else published, f"{worker} died")

    def missed(self, worker: str, unit, published: int) -> None:
        """``worker``'s inbox lost ``unit``'s version with the group (a member lost mid-broadcast):
        the run is on the object store, and the unit goes to ``worker`` again with rank 0's copy."""
        self.retire(self.publishing if self.publishing is not None else published, f"{worker} missed it")
        if unit.version not in self.packets:
            self._request(unit.version, published)

    def retire(self, holds: int, why: str) -> None:
        """Switch to the object store and take the group down (:func:`close_group`: every member
        aborts its end, so no one waits for a lost member -- an NCCL peer never notices one);
        rank 0's copy of the version it holds (a member may have lost that version with a broken
        broadcast)."""
        if self.transport == "broadcast":
            print(
                f"warning: weight sync falls back to the Ray object store for the rest of the run ({why})",
                file=sys.stderr,
            )
            self.transport = "object_store"
            close_group(self.store)
        if holds not in self.packets:
            self.packets[holds] = self.actors[self.rank0].publish.remote()

    def prune(self, oldest: int) -> None:
        self.packets = {v: p for v, p in self.packets.items() if v >= oldest}
