"""DDP-style bucketed gradient all-reduce, for ranks whose trained parameters are replicated.

Gradients are packed into fixed-size buckets (one dtype per bucket), each bucket all-reduced and
unpacked back, so the extra memory is two buckets, never a flat copy of every gradient. The next
bucket is packed while the previous one is in flight. A parameter with no gradient on this rank
(it trained nothing this iteration) contributes zeros, so every rank issues the same collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def gradient_buckets(
    params: list[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[list[torch.Tensor]]:
    """Consecutive parameters grouped by dtype into buckets of at most ``bucket_bytes`` (a
    parameter larger than that is a bucket alone). The same on every rank for the same list."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list, int]] = {}
    for p in params:
        size = p.numel() * p.element_size()
        members, used = open_bucket.get(p.dtype, ([], 0))
        if members and used + size > bucket_bytes:
            buckets.append(members)
            members, used = [], 0
        members.append(p)
        open_bucket[p.dtype] = (members, used + size)
    buckets.extend(members for members, _ in open_bucket.values() if members)
    return buckets


def _pack(bucket: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
    offset = 0
    for p in bucket:
        n = p.numel()
        if p.grad is None:
            flat[offset : offset + n].zero_()
        else:
            flat[offset : offset + n].copy_(p.grad.reshape(-1))
        offset += n
    return flat


def _unpack(bucket: list[torch.Tensor], flat: torch.Tensor, scale: float | None) -> None:
    if scale is not None:
        flat.mul_(scale)
    offset = 0
    for p in bucket:
        n = p.numel()
        view = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)
        offset += n


def all_reduce_gradients(
    params: list[torch.Tensor], group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, average: bool = False
) -> int:
    """Sum (or average) the gradients of ``params`` over ``group``; returns the bucket count.
    Nothing happens in a world of one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    scale = 1.0 / dist.get_world_size(group) if average else None
    buckets = gradient_buckets(params, bucket_bytes)
    in_flight = None
    for bucket in buckets:
        flat = _pack(bucket)  # packed while the previous bucket is still being reduced
        work = dist.all_reduce(flat, group=group, async_op=True)
        if in_flight is not None:
            in_flight[2].wait()
            _unpack(in_flight[0], in_flight[1], scale)
        in_flight = (bucket, flat, work)
    if in_flight is not None:
        in_flight[2].wait()
        _unpack(in_flight[0], in_flight[1], scale)
    return len(buckets)


def all_reduce_tensors(
    tensors: list[torch.Tensor], group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> int:
    """Sum ``tensors`` in place over ``group``, in the same buckets (HSDP: each rank's local gradient
    shards over its replicas, which hold the same shards). Returns the bucket count."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    buckets = gradient_buckets(tensors, bucket_bytes)
    in_flight = None
    for bucket in buckets:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        work = dist.all_reduce(flat, group=group, async_op=True)
        if in_flight is not None:
            _copy_back(*in_flight)
        in_flight = (bucket, flat, work)
    if in_flight is not None:
        _copy_back(*in_flight)
    return len(buckets)


def _copy_back(bucket: list[torch.Tensor], flat: torch.Tensor, work) -> None:
    work.wait()
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
