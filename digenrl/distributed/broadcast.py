"""Weight sync at GB scale: bucketed broadcast from one source rank over a standalone process
group (gloo on CPU, NCCL on GPU), verified by per-tensor fingerprints, with prefetch.

Protocol of one version (every member issues the same collectives in the same order):

1. header: JSON (version, bucket size, each tensor's name / shape / dtype), as a length then bytes;
2. buckets: the tensors' bytes, concatenated in header order into buffers of about
   ``bucket_bytes`` (one broadcast per bucket: one flat buffer is ~5x faster than many tensors);
3. trailer: the source's fingerprint of every tensor (:mod:`.fingerprint`), computed on its
   device while packing.

A receiver can run steps 1-3 on a background thread (:meth:`WeightReceiver.prefetch`) into
staging buffers while its main thread generates, then :meth:`WeightReceiver.load` copies the
staged bytes into its own tensors at a unit boundary and checks, once, that every loaded tensor's
fingerprint equals the source's. A mismatch names the tensor and its bucket.

The group is its own ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over its own ``TCPStore``: it
does not need, or disturb, the trainer ranks' default process group.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from digenrl.distributed.fingerprint import fingerprint, fingerprints
from digenrl.errors import WeightSyncError

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * getattr(torch, self.dtype).itemsize

    @staticmethod
    def of(name: str, t: torch.Tensor) -> TensorSpec:
        return TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))


def bucket_layout(specs: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``specs`` per bucket, in order; a tensor larger than a bucket is a bucket alone."""
    buckets: list[list[int]] = []
    used = 0
    for i, spec in enumerate(specs):
        if not buckets or (used + spec.nbytes > bucket_bytes and buckets[-1]):
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += spec.nbytes
    return buckets


class SyncGroup:
    """A standalone process group between a weight source (usually trainer rank 0) and the
    rollout workers. Every member calls it with the same address, port and size."""

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
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
        else:
            raise ValueError(f"unknown backend {backend!r} (gloo or nccl)")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)  # where collective buffers live (cuda for NCCL)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
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


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _event(direction: str, version: int, start: float, end: float, nbytes: int, **args) -> dict:
    """A timeline span of kind "sync", shaped like the engine's weight-sync events."""
    return {
        "kind": "sync",
        "uid": f"sync-{version}-{direction}",
        "version": version,
        "start": start,
        "end": end,
        "args": {"direction": direction, "bytes": nbytes, "transport": "broadcast", **args},
    }


def digest(names: list[str], prints: torch.Tensor) -> str:
    """One short hash of a version's names and per-tensor fingerprints (sorted by name), so the
    source's and each receiver's copy can be compared in a log or a timeline."""
    h = hashlib.sha256()
    for name, row in sorted(zip(names, prints.tolist())):
        h.update(f"{name}:{row[0]},{row[1]},{row[2]};".encode())
    return h.hexdigest()[:16]


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
        event = _event(
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
                buf[offset : offset + specs[i].nbytes].copy_(_bytes_of(t))
                offset += specs[i].nbytes
            self.group.broadcast(buf, self.src)
            if kept is not None:
                kept.append(buf.to("cpu"))
        return torch.stack(prints).cpu() if prints else torch.zeros(0, 3, dtype=torch.int64)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


@dataclass
class Received:
    """One version staged on a receiver, not yet loaded."""

    version: int
    specs: list[TensorSpec]
    buckets: list[torch.Tensor]  # uint8 staging buffers
    layout: list[list[int]]
    fingerprints: torch.Tensor  # (n, 3), the source's
    event: dict

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


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

    def receive(self) -> Received:
        start = time.time()
        header = json.loads(self.group.broadcast_bytes(None, self.src))
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
            _event("prefetch", header["version"], start, end, sum(s.nbytes for s in specs)),
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
        problem = _mismatch(version, specs, targets)
        for bucket in layout:
            buf = torch.empty(
                sum(specs[i].nbytes for i in bucket), dtype=torch.uint8, device=self.group.device
            )
            self.group.broadcast(buf, self.src)
            if not problem:
                _unpack(specs, bucket, buf, targets)
        prints = torch.tensor(json.loads(self.group.broadcast_bytes(None, self.src)), dtype=torch.int64)
        if problem:
            raise WeightSyncError(problem)
        got = _verify(version, specs, layout, prints.reshape(-1, 3), targets)
        return _event(
            "receive_into",
            version,
            start,
            time.time(),
            sum(s.nbytes for s in specs),
            digest=digest([s.name for s in specs], got),
        )


def load_received(received: Received, targets: dict[str, torch.Tensor]) -> dict:
    """Copy a staged version into ``targets`` (name -> the receiver's own tensor, written in
    place), then check keys, shapes, dtypes and every fingerprint once; returns the "load" event
    (``args.digest``: of the fingerprints of the loaded tensors)."""
    start = time.time()
    problem = _mismatch(received.version, received.specs, targets)
    if problem:
        raise WeightSyncError(problem)
    for bucket, buf in zip(received.layout, received.buckets):
        _unpack(received.specs, bucket, buf, targets)
    got = _verify(received.version, received.specs, received.layout, received.fingerprints, targets)
    return _event(
        "load",
        received.version,
        start,
        time.time(),
        received.nbytes,
        digest=digest([s.name for s in received.specs], got),
    )


@torch.no_grad()
def received_from(
    version: int,
    tensors: dict[str, torch.Tensor],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    staging_device: torch.device | str = "cpu",
) -> Received:
    """``tensors`` staged as a version without any group (a copy, with their fingerprints): a
    receiver's own starting weights kept for a re-queued unit, or a staged version handed on."""
    start = time.time()
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    layout = bucket_layout(specs, bucket_bytes)
    values = list(tensors.values())
    buckets = [torch.cat([_bytes_of(values[i]).to(staging_device) for i in bucket]) for bucket in layout]
    prints = fingerprints(values)
    return Received(
        version,
        specs,
        buckets,
        layout,
        prints,
        _event("stage", version, start, time.time(), sum(s.nbytes for s in specs)),
    )


def _mismatch(version: int, specs: list[TensorSpec], targets: dict[str, torch.Tensor]) -> str | None:
    """Why ``targets`` cannot take ``specs`` (keys, shapes, dtypes), or None."""
    names = [s.name for s in specs]
    missing, unexpected = sorted(set(targets) - set(names)), sorted(set(names) - set(targets))
    if missing or unexpected:
        return (
            f"broadcast of version {version}: {len(missing)} missing keys {missing[:3]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:3]}"
        )
    for spec in specs:
        dest = targets[spec.name]
        if TensorSpec.of(spec.name, dest) != spec:
            return (
                f"broadcast of version {version}: {spec.name} is {tuple(dest.shape)} {dest.dtype} here, "
                f"{spec.shape} {spec.dtype} sent"
            )
    return None


@torch.no_grad()
def _unpack(
    specs: list[TensorSpec], bucket: list[int], buf: torch.Tensor, targets: dict[str, torch.Tensor]
) -> None:
    offset = 0
    for i in bucket:
        spec = specs[i]
        dest = targets[spec.name]
        _bytes_of_inplace(dest).copy_(buf[offset : offset + spec.nbytes].to(dest.device))
        offset += spec.nbytes


def _verify(
    version: int,
    specs: list[TensorSpec],
    layout: list[list[int]],
    expected: torch.Tensor,
    targets: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Every loaded tensor's fingerprint equals the source's; else name the first bad one and its
    bucket. Returns the loaded tensors' fingerprints."""
    names = [s.name for s in specs]
    got = fingerprints([targets[n] for n in names])
    bad = [i for i, (a, e) in enumerate(zip(got, expected)) if not torch.equal(a, e)]
    if bad:
        bucket = next(b for b, members in enumerate(layout) if bad[0] in members)
        raise WeightSyncError(
            f"broadcast of version {version}: fingerprint mismatch after load in "
            f"{len(bad)} tensors, first {names[bad[0]]} (bucket {bucket})"
        )
    return got


def _bytes_of_inplace(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise WeightSyncError("broadcast: destination tensors must be contiguous")
    return t.view(-1).view(torch.uint8)


def sync_targets(model: torch.nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """What a weight sync writes on a receiver: the LoRA parameters (by parameter name) with
    LoRA, every state-dict tensor otherwise. The source uses the same names."""
    if lora:
        return {n: p.data for n, p in model.named_parameters() if "lora_" in n}
    return dict(model.state_dict())


def specs_for(tensors: dict[str, torch.Tensor], send_dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """The specs of ``tensors`` as they will be sent (global shapes for DTensor shards), so a
    source can publish a stream of gathered tensors without holding them all."""
    return [
        TensorSpec(
            n,
            tuple(t.shape),
            str(send_dtype if send_dtype is not None and t.is_floating_point() else t.dtype).removeprefix(
                "torch."
            ),
        )
        for n, t in tensors.items()
    ]
