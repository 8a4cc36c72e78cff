"""A version of the weights staged in memory and its verified load: the tensors' specs and bucket
layout (the wire format of :mod:`.broadcast`), :class:`Received` (a version's buckets and the
source's fingerprints), :func:`load_received` (copy into a receiver's tensors, check every
fingerprint once) and :func:`received_from` (a version staged without any group)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from digenrl.distributed.fingerprint import fingerprints
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


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def sync_span(direction: str, version: int, start: float, end: float, nbytes: int, **args) -> dict:
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


def load_received(received: Received, targets: dict[str, torch.Tensor]) -> dict:
    """Copy a staged version into ``targets`` (name -> the receiver's own tensor, written in
    place), then check keys, shapes, dtypes and every fingerprint once; returns the "load" event
    (``args.digest``: of the fingerprints of the loaded tensors)."""
    start = time.time()
    problem = mismatch(received.version, received.specs, targets)
    if problem:
        raise WeightSyncError(problem)
    for bucket, buf in zip(received.layout, received.buckets):
        unpack(received.specs, bucket, buf, targets)
    got = verify(received.version, received.specs, received.layout, received.fingerprints, targets)
    return sync_span(
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
    buckets = [torch.cat([bytes_of(values[i]).to(staging_device) for i in bucket]) for bucket in layout]
    prints = fingerprints(values)
    return Received(
        version,
        specs,
        buckets,
        layout,
        prints,
        sync_span("stage", version, start, time.time(), sum(s.nbytes for s in specs)),
    )


def mismatch(version: int, specs: list[TensorSpec], targets: dict[str, torch.Tensor]) -> str | None:
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
def unpack(
    specs: list[TensorSpec], bucket: list[int], buf: torch.Tensor, targets: dict[str, torch.Tensor]
) -> None:
    offset = 0
    for i in bucket:
        spec = specs[i]
        dest = targets[spec.name]
        _bytes_of_inplace(dest).copy_(buf[offset : offset + spec.nbytes].to(dest.device))
        offset += spec.nbytes


def verify(
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
    LoRA, every state-dict tensor otherwise -- of the trained experts only where a model of two
    (Wan2.2 A14B, ``model.train_experts``) keeps one frozen: it never changes, so it never ships nor
    is gathered. The source uses the same names."""
    if lora:
        return {n: p.data for n, p in model.named_parameters() if "lora_" in n}
    trained = getattr(model, "trained", None)  # adapters.experts.Experts: the trained experts' names
    state = model.state_dict()
    return state if trained is None else {k: v for k, v in state.items() if k.split(".", 1)[0] in trained}


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
