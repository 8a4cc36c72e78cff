"""Weight sync at GB scale: bucketed broadcast from one source rank over a standalone process
group (gloo on CPU, NCCL on GPU), verified by per-tensor fingerprints, with prefetch.

Details: docs/modules.md, `digenrl.distributed.broadcast`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from digenrl.distributed.fingerprint import fingerprint
from digenrl.distributed.staged import (
    DEFAULT_BUCKET_BYTES,
    Received,
    TensorSpec,
    bucket_layout,
    bytes_of,
    digest,
    load_received,
    mismatch,
    sync_span,
    unpack,
    verify,
)
from digenrl.errors import WeightSyncError

CLOSED = "closed"  # store key: the group is over (its source closed it, or the driver took it down)
WATCH_WAIT = datetime.timedelta(hours=1)  # a member's watcher re-checks that the store still answers


def nccl_group(store, rank: int, world_size: int, timeout: datetime.timedelta):
    """A ``ProcessGroupNCCL`` whose collectives give up after ``timeout`` (without options NCCL
    waits its default 10-30 min: a dead peer is never seen, the others hang)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


class SyncGroup:
    """A standalone process group between a weight source (usually trainer rank 0) and the
    rollout workers. Every member calls it with the same address, port and size.

    Each member watches the group's store for :data:`CLOSED` on a thread of its own (with a client
    of its own, so no store call waits behind it): once any member or the driver
    (:func:`close_group`) sets it, the member aborts its end of the group (:meth:`abort`), so a
    collective waiting for a lost member ends in seconds, NCCL's included; ``down`` tells."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        device: torch.device | str = "cpu",
    ):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        elif backend == "nccl":
            self.pg = nccl_group(self.store, rank, world_size, timeout)
        else:
            raise ValueError(f"unknown backend {backend!r} (gloo or nccl)")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)  # where collective buffers live (cuda for NCCL)
        self.down = threading.Event()  # the group was taken down: no collective will complete
        watch = dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
        threading.Thread(target=self._watch, args=(watch,), name="sync-group-watch", daemon=True).start()

    def _watch(self, store) -> None:
        """Until the group is closed (or its store is gone with its source): then abort it."""
        while not self.down.is_set():
            try:
                store.wait([CLOSED], WATCH_WAIT)
                break
            except Exception:  # noqa: BLE001 -- an hour without news, or a store that broke
                try:
                    if store.check([CLOSED]):
                        break
                except Exception:  # noqa: BLE001 -- the store is gone (its master, rank 0, died)
                    break
        self.abort()

    def close(self) -> None:
        """End the group for every member: each one's watcher aborts its end."""
        with contextlib.suppress(Exception):
            self.store.set(CLOSED, "1")
        self.abort()

    def abort(self) -> None:
        """Abort this member's end: NCCL's pending collectives fail at once (``abort``); gloo's
        connections close as its group is dropped, so the peers' pending collectives fail too."""
        self.down.set()
        pg, self.pg = self.pg, None
        if pg is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):
                pg.abort()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.pg is None:  # (no local name for it: a traceback must not keep a dropped group alive)
            raise WeightSyncError("the weight-sync group was taken down (a member was lost)")
        self.pg.broadcast(tensor, src).wait()

    def broadcast_bytes(self, payload: bytes | None, src: int) -> bytes:
        size = torch.tensor(
            [len(payload) if payload is not None else 0], dtype=torch.int64, device=self.device
        )
        self.broadcast(size, src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(buf, src)
        return buf.cpu().numpy().tobytes()


def close_group(address: tuple[str, int] | None, timeout_s: float = 5.0) -> bool:
    """The driver takes a weight-sync group down (a member was lost: it never waits for the others
    to notice, NCCL peers hang): sets the group's :data:`CLOSED` key, so every member's watcher
    aborts its end. Whether the store answered (a store gone with rank 0 needs nothing more)."""
    if address is None:
        return False
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(*address, None, False, timeout, wait_for_workers=False)
        store.set(CLOSED, "1")
    except Exception:  # noqa: BLE001
        return False
    return True


class WeightBroadcaster:
    """The source side: ``publish`` one version to every receiver of the group."""

    def __init__(self, group: SyncGroup, src: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.group, self.src, self.bucket_bytes = group, src, bucket_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-publish")
        self.keep_sent = False  # keep each version's sent buckets, in host memory, as ``last_sent``
        self.last_sent: Received | None = None

    def publish(
        self,
        version: int,
        tensors,
        specs: list[TensorSpec] | None = None,
        send_dtype: torch.dtype | None = None,
    ) -> dict:
        """Send ``tensors`` (a mapping, or an iterable of (name, tensor) with ``specs`` given --
        e.g. FSDP full tensors gathered one at a time) as ``version``; blocks until sent.
        ``send_dtype`` casts floating tensors first (fp32 masters shipped as bf16). Returns the
        sync event."""
        start = time.time()
        items = list(tensors.items()) if isinstance(tensors, dict) else tensors
        if specs is None:
            items = list(items)
            specs = [TensorSpec.of(n, _cast(t, send_dtype)) for n, t in items]
        header = {
            "version": version,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[s.name, list(s.shape), s.dtype] for s in specs],
        }
        self.group.broadcast_bytes(json.dumps(header).encode(), self.src)
        kept = [] if self.keep_sent else None
        prints = self._send_buckets(specs, iter(items), send_dtype, kept)
        self.group.broadcast_bytes(json.dumps(prints.tolist()).encode(), self.src)
        event = sync_span(
            "publish",
            version,
            start,
            time.time(),
            sum(s.nbytes for s in specs),
            digest=digest([s.name for s in specs], prints),
        )
        if kept is not None:
            self.last_sent = Received(
                version, specs, kept, bucket_layout(specs, self.bucket_bytes), prints, event
            )
        return event

    def publish_async(
        self, version: int, tensors: dict[str, torch.Tensor], send_dtype: torch.dtype | None = None
    ) -> Future:
        """Snapshot ``tensors`` now (one copy, in ``send_dtype``), send them on a background
        thread; the caller may step the optimizer meanwhile. One publish in flight at a time."""
        snapshot = {n: _cast(t, send_dtype).clone() for n, t in tensors.items()}
        return self._pool.submit(self.publish, version, snapshot)

    def _send_buckets(self, specs, items, send_dtype, kept: list | None = None) -> torch.Tensor:
        """Pack and broadcast; a floating tensor is cast to ``send_dtype``, or without one to its
        spec's dtype (the receivers' dtypes, e.g. fp32 masters into a bf16 rollout copy).
        ``kept``: receives each sent bucket, in host memory."""
        prints = []
        for bucket in bucket_layout(specs, self.bucket_bytes):
            buf = torch.empty(
                sum(specs[i].nbytes for i in bucket), dtype=torch.uint8, device=self.group.device
            )
            offset = 0
            for i in bucket:
                name, t = next(items)
                t = _cast(t, send_dtype if send_dtype is not None else getattr(torch, specs[i].dtype))
                if TensorSpec.of(name, t) != specs[i]:
                    raise WeightSyncError(f"publish: tensor {name} does not match its spec {specs[i]}")
                prints.append(fingerprint(t).to(self.group.device))
                buf[offset : offset + specs[i].nbytes].copy_(bytes_of(t))
                offset += specs[i].nbytes
            self.group.broadcast(buf, self.src)
            if kept is not None:
                kept.append(buf.to("cpu"))
        return torch.stack(prints).cpu() if prints else torch.zeros(0, 3, dtype=torch.int64)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


class WeightReceiver:
    """The receiving side. ``receive()`` blocks; ``prefetch()`` runs it on a background thread
    (the group must see no other collective from this process meanwhile); ``load()`` copies a
    staged version into the receiver's tensors and verifies it."""

    def __init__(self, group: SyncGroup, src: int = 0, staging_device: torch.device | str | None = None):
        self.group, self.src = group, src
        self.staging_device = torch.device(staging_device) if staging_device is not None else group.device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-prefetch")
        self._pending: Future | None = None
        self._lock = threading.Lock()

    def receive(self, midway=None) -> Received:
        """Receive the next version; ``midway(version)``, when given, runs once its header is in
        (a fault plugin may end the process there: a member lost mid-broadcast)."""
        start = time.time()
        header = json.loads(self.group.broadcast_bytes(None, self.src))
        if midway is not None:
            midway(header["version"])
        specs = [TensorSpec(n, tuple(s), d) for n, s, d in header["tensors"]]
        layout = bucket_layout(specs, header["bucket_bytes"])
        buckets = []
        for bucket in layout:
            buf = torch.empty(
                sum(specs[i].nbytes for i in bucket), dtype=torch.uint8, device=self.group.device
            )
            self.group.broadcast(buf, self.src)
            buckets.append(buf.to(self.staging_device))
        prints = torch.tensor(json.loads(self.group.broadcast_bytes(None, self.src)), dtype=torch.int64)
        end = time.time()
        return Received(
            header["version"],
            specs,
            buckets,
            layout,
            prints.reshape(-1, 3),
            sync_span("prefetch", header["version"], start, end, sum(s.nbytes for s in specs)),
        )

    def prefetch(self) -> Future:
        """Start receiving the next version on a background thread; returns its future."""
        with self._lock:
            if self._pending is not None and not self._pending.done():
                raise RuntimeError("a prefetch is already in flight")
            self._pending = self._pool.submit(self.receive)
            return self._pending

    def ready(self) -> bool:
        return self._pending is not None and self._pending.done()

    def wait(self) -> Received:
        if self._pending is None:
            raise RuntimeError("no prefetch was started")
        pending, self._pending = self._pending, None
        return pending.result()

    def load(self, received: Received, targets: dict[str, torch.Tensor]) -> dict:
        """Copy ``received`` into ``targets`` (name -> the receiver's own tensor, written in
        place), then check the keys, shapes, dtypes and every fingerprint; returns the event."""
        return load_received(received, targets)

    def receive_into(self, targets: dict[str, torch.Tensor]) -> dict:
        """Receive the next version straight into ``targets``, one bucket buffer at a time (no
        staged copy of the whole version: full weights at GB scale when there is nothing to
        overlap with), then verify as :meth:`load`. Call it only at a unit boundary: the
        targets change while it runs. Every bucket is received even when the targets do not
        fit, so the group stays in step; the mismatch is raised after."""
        start = time.time()
        header = json.loads(self.group.broadcast_bytes(None, self.src))
        version = header["version"]
        specs = [TensorSpec(n, tuple(s), d) for n, s, d in header["tensors"]]
        layout = bucket_layout(specs, header["bucket_bytes"])
        problem = mismatch(version, specs, targets)
        for bucket in layout:
            buf = torch.empty(
                sum(specs[i].nbytes for i in bucket), dtype=torch.uint8, device=self.group.device
            )
            self.group.broadcast(buf, self.src)
            if not problem:
                unpack(specs, bucket, buf, targets)
        prints = torch.tensor(json.loads(self.group.broadcast_bytes(None, self.src)), dtype=torch.int64)
        if problem:
            raise WeightSyncError(problem)
        got = verify(version, specs, layout, prints.reshape(-1, 3), targets)
        return sync_span(
            "receive_into",
            version,
            start,
            time.time(),
            sum(s.nbytes for s in specs),
            digest=digest([s.name for s in specs], got),
        )
