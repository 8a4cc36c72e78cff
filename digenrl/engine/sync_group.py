"""The weight-sync group of the engine (``engine.weight_sync: broadcast``): trainer rank 0's
:class:`BroadcastPublisher` and each rollout worker's :class:`BroadcastInbox`, over a
:class:`~digenrl.distributed.broadcast.SyncGroup` of their own.

Details: docs/modules.md, `digenrl.engine.sync_group`.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import torch
from torch.distributed import DistStoreError

from digenrl.distributed.broadcast import CLOSED, SyncGroup, WeightBroadcaster, WeightReceiver
from digenrl.distributed.staged import Received, TensorSpec, load_received, received_from, sync_targets
from digenrl.errors import WeightSyncError
from digenrl.policy.lora import full_tensor

SYNC_TIMEOUT_S = 300.0  # forming the group, and any one bucket in flight
# An idle receiver blocks on the store for the next announcement (woken the moment rank 0 sets it,
# or sets it to CLOSED); it re-checks the CLOSED key this often when nothing came at all.
ANNOUNCE_WAIT = timedelta(hours=1)
TAKE_POLL_S = 0.25  # a unit boundary waiting for a version: how often it looks whether the group went down


class VersionMissed(WeightSyncError):
    """A rollout worker's inbox will not receive the version a unit needs: the group went down
    (a member was lost mid-broadcast) before it arrived. The worker hands the unit back and the
    driver sends it again with rank 0's object-store copy of that version."""


def _announced(seq: int) -> str:
    """Store key rank 0 sets right before its ``seq``-th publish (to the version), or to
    ``CLOSED`` when it publishes no more: receivers block on it, then join the bucket broadcasts."""
    return f"announce/{seq}"


def _wait_announced(store, seq: int) -> bool:
    """Block until rank 0 announces its ``seq``-th publish (True) or closes the group (False). No
    timeout however long an iteration takes; a store that broke (rank 0 gone) raises."""
    while True:
        try:
            store.wait([_announced(seq)], ANNOUNCE_WAIT)
        except DistStoreError:  # nothing in an hour: still open?
            if store.check([CLOSED]):
                return False
            continue
        return store.get(_announced(seq)) != CLOSED.encode()


def sync_backend(devices: list[str], layout) -> str:
    """The weight-sync group's backend: NCCL when every member is on a GPU, unless a rollout worker
    is also in a sequence-parallel group -- its inbox receives on a background thread while its
    forward all-to-alls, and two NCCL communicators with kernels in flight on one GPU can deadlock --
    then gloo (host buffers: no GPU kernels beside the all-to-alls), as off GPUs."""
    if layout.rollout_sp_groups or not all(d.startswith("cuda") for d in devices):
        return "gloo"
    return "nccl"


def receiver_specs(policy) -> list[TensorSpec]:
    """What a rollout worker's load writes: names, shapes and dtypes of its sync targets."""
    return [TensorSpec.of(n, t) for n, t in sync_targets(policy.adapter.transformer, policy.lora).items()]


def publish_stream(policy):
    """(name, full tensor) of a version, in a fixed order; on FSDP2-sharded trainer ranks each
    full tensor is a gather that every rank joins in this same order."""
    net = policy.adapter.transformer
    state = net.state_dict()  # on FSDP2 ranks: DTensor shards, gathered one at a time below
    for name in sync_targets(net, policy.lora):
        yield name, full_tensor(state[name]).detach()


def take_part(policy, transport: str) -> None:
    """A sharded trainer rank > 0: its part of rank 0's gathers for a publish."""
    if transport == "broadcast":
        for _ in publish_stream(policy):
            pass
    else:
        policy.weights()


def _publisher_specs(policy, theirs: list[TensorSpec]) -> list[TensorSpec]:
    """Rank 0's tensors in its own order, sent in the receivers' dtypes (fp32 masters go out in the
    rollout copy's compute dtype); the names and shapes must be the receivers'."""
    own = sync_targets(policy.adapter.transformer, policy.lora)
    by_name = {s.name: s for s in theirs}
    missing, unexpected = sorted(set(by_name) - set(own)), sorted(set(own) - set(by_name))
    if missing or unexpected:
        raise WeightSyncError(
            f"weight sync: trainer rank 0 lacks {len(missing)} tensors the rollout workers load "
            f"{missing[:3]} and has {len(unexpected)} they do not {unexpected[:3]}"
        )
    specs = []
    for name, t in own.items():
        if tuple(t.shape) != by_name[name].shape:
            raise WeightSyncError(
                f"weight sync: {name} is {tuple(t.shape)} on trainer rank 0, "
                f"{by_name[name].shape} on the rollout workers"
            )
        specs.append(TensorSpec(name, tuple(t.shape), by_name[name].dtype))
    return specs


class BroadcastPublisher:
    """Trainer rank 0's end of the group: one :meth:`publish` per version, after the step. With
    ``keep`` > 0 it keeps the last ``keep`` versions it sent (their buckets, in host memory): a
    rollout worker restarted outside the group may need a version rank 0 has already stepped past."""

    def __init__(self, group: SyncGroup, specs: list[TensorSpec], keep: int = 0):
        self.group, self.specs, self.sender = group, specs, WeightBroadcaster(group)
        self.seq, self.closed, self.keep = 0, False, keep
        self.sender.keep_sent = keep > 0
        self.staged: dict[int, Received] = {}  # the versions kept, by version

    def publish(self, policy, corrupt=None) -> dict:
        """Broadcast the policy's version; raises when the group broke (a member gone), after
        finishing the gathers so the other trainer ranks stay in step. ``corrupt``: a fault
        plugin's wrapper of the group for this version (:func:`digenrl.engine.faults.corrupting`)."""
        stream = publish_stream(policy)
        try:
            self.group.store.set(_announced(self.seq), str(policy.version))
            self.seq += 1
            with corrupt(self.group) if corrupt is not None else contextlib.nullcontext():
                event = self.sender.publish(policy.version, stream, specs=self.specs)
        except Exception:
            for _ in stream:
                pass
            self.close()
            raise
        if self.keep:
            self.staged[policy.version] = self.sender.last_sent
            for v in sorted(self.staged)[: -self.keep]:
                del self.staged[v]
        return {**event, "iteration": policy.version - 1}

    def close(self) -> None:
        """No more versions over the group: the receivers' threads end (a waiting one is woken, one
        inside a broadcast sees the group aborted: :meth:`SyncGroup.close`)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                self.group.store.set(_announced(self.seq), CLOSED)  # wakes a waiting receiver
            self.group.close()


class BroadcastInbox:
    """A rollout worker's end: a background thread receives every version as rank 0 publishes
    it (staged in host memory) while the main thread generates; :meth:`take` hands the unit
    boundary the version a unit needs. Keeps the versions a unit may still ask for
    (``engine.max_staleness`` behind the newest)."""

    def __init__(self, group: SyncGroup, max_staleness: int, midway=None, received=None):
        self.group, self.max_staleness, self.midway = group, max_staleness, midway
        self.on_received = received  # (engine.faults: a version lost after it arrived)
        self.receiver = WeightReceiver(group, staging_device="cpu")
        self.staged: dict[int, Received] = {}
        self.events: list[dict] = []
        self.problem: str | None = None  # why no more versions will arrive
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="weight-prefetch", daemon=True)
        self.thread.start()

    def keep(self, received: Received) -> None:
        with self.cond:
            self.staged[received.version] = received

    def _run(self) -> None:
        store, seq = self.group.store, 0
        try:
            while True:
                if store.check([CLOSED]) or not _wait_announced(store, seq):
                    return self._stop("trainer rank 0 publishes through the object store now")
                with _side_stream(self.group.device):
                    received = self.receiver.receive(self.midway)
                if self.on_received is not None:
                    self.on_received(received.version)
                seq += 1
                with self.cond:
                    self.staged[received.version] = received
                    self.events.append({**received.event, "iteration": received.version - 1})
                    newest = max(self.staged)
                    for v in [v for v in self.staged if v < newest - self.max_staleness]:
                        del self.staged[v]
                    self.cond.notify_all()
        except Exception as exc:  # noqa: BLE001 -- a member gone: the driver switches to the object store
            self.group.close()  # (this end broke: take the group down, so no member waits for it)
            self._stop(f"the group broke: {type(exc).__name__}: {str(exc)[:120]}")

    def _stop(self, why: str) -> None:
        with self.cond:
            self.problem = why
            self.cond.notify_all()

    def take(self, version: int) -> Received:
        """The staged ``version``, waiting for the thread when it is still arriving; raises
        :class:`VersionMissed` at once when the group went down without it (never waiting for the
        thread's collective to time out: an NCCL one may never end)."""
        with self.cond:
            while version not in self.staged:
                if self.problem is not None or self.group.down.is_set():
                    raise VersionMissed(
                        f"weights of version {version} were not received by broadcast "
                        f"({self.problem or 'the group was taken down'})"
                    )
                self.cond.wait(timeout=TAKE_POLL_S)
            return self.staged[version]

    def stopped(self, timeout: float) -> bool:
        """Whether the receiving thread has ended, waiting up to ``timeout`` s (after rank 0 closed)."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def drain_events(self) -> list[dict]:
        """The prefetch spans recorded since the last call (for the timeline)."""
        with self.cond:
            events, self.events = self.events, []
        return events


def _side_stream(device: torch.device):
    """Receive NCCL buckets on their own CUDA stream, so they do not queue behind generation."""
    if device.type == "cuda":
        return torch.cuda.stream(torch.cuda.Stream(device))
    return contextlib.nullcontext()


def join(policy, address: str, port: int, rank: int, world: int, backend: str, specs, staleness, faults=None):
    """Join the weight-sync group: rank 0 (trainer rank 0, given the receivers' ``specs``)
    returns its publisher, a rollout worker its inbox (holding its starting weights as a staged
    version when a re-queued unit may still ask for them after it has moved on). ``faults``: the
    worker's fault plugin; a rollout worker's ``sync-<version>`` fault ends it mid-broadcast."""
    device = policy.device if backend == "nccl" else "cpu"  # (gloo: buffers in host memory)
    group = SyncGroup(rank, world, address, port, backend=backend, timeout_s=SYNC_TIMEOUT_S, device=device)
    if rank == 0:  # with one-step async, keep what a restarted rollout worker may still need
        keep = staleness + 1 if staleness else 0
        return BroadcastPublisher(group, _publisher_specs(policy, specs), keep=keep)
    midway = (lambda v: faults.reached(f"sync-{v}")) if faults is not None else None
    received = (lambda v: faults.reached(f"sync-{v}:received")) if faults is not None else None
    inbox = BroadcastInbox(group, staleness, midway, received)
    if staleness > 0:
        inbox.keep(received_from(policy.version, sync_targets(policy.adapter.transformer, policy.lora)))
    return inbox


def carry_over(old, new) -> None:
    """A member that joined a re-formed group keeps the versions it staged in the old one (a re-queued
    unit may still ask for one of them)."""
    if old is None or new is None or not hasattr(old, "staged"):
        return
    for version, received in old.staged.items():
        new.staged.setdefault(version, received)


def staged_copy(sync, version: int, name: str) -> Received:
    """A version trainer rank 0 sent (or a rollout worker received) by broadcast, for a rollout
    worker restarted outside the group."""
    if sync is None or version not in sync.staged:
        raise WeightSyncError(
            f"{name} does not hold version {version} of the weights for a restarted rollout worker"
        )
    return sync.staged[version]


def load_staged(policy, received: Received, iteration: int, transport: str = "broadcast") -> dict:
    """Load a staged version into the policy at a unit boundary (keys, shapes, dtypes and every
    fingerprint checked once); returns the sync event, a "fetch" as over the object store."""
    event = load_received(received, sync_targets(policy.adapter.transformer, policy.lora))
    policy.version = received.version
    return {
        **event,
        "uid": f"sync-{received.version}-fetch",
        "iteration": iteration,
        "args": {**event["args"], "direction": "fetch", "transport": transport},
    }
