"""A per-tensor fingerprint computed on the tensor's own device, for verifying weight transfers.

Details: docs/modules.md, `digenrl.distributed.fingerprint`.
"""

from __future__ import annotations

import torch

_MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant, odd: distinct weights mod 2^32
_ROW = 1024
_ROWS_PER_PASS = 1 << 14  # 16M values per pass: column sums stay < 2^29; temporaries 64 MiB


def _as_int(t: torch.Tensor) -> torch.Tensor:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return raw.view(torch.int16) if raw.numel() % 2 == 0 else raw.view(torch.int8)


def _weights(start: int, n: int, device) -> torch.Tensor:
    w = torch.arange(start + 1, start + n + 1, device=device, dtype=torch.int64)
    return w.mul_(_MULTIPLIER).bitwise_and_(0xFFFFFFFF)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64 tensor (3,) on ``t``'s device; equal fingerprints for bit-identical tensors."""
    x = _as_int(t)
    full = x.numel() // _ROW
    cols = torch.zeros(_ROW, dtype=torch.int64, device=x.device)
    out = torch.zeros(3, dtype=torch.int64, device=x.device)
    for row in range(0, full, _ROWS_PER_PASS):
        block = x[row * _ROW : min(full, row + _ROWS_PER_PASS) * _ROW].view(-1, _ROW).to(torch.int32)
        rows = block.sum(1, dtype=torch.int32).to(torch.int64)
        cols += block.sum(0, dtype=torch.int32)
        out[0] += rows.sum()
        out[1] += rows.mul_(_weights(row, rows.numel(), x.device)).sum()
    tail = x[full * _ROW :].to(torch.int64)
    if tail.numel():
        cols[: tail.numel()] += tail
        out[0] += tail.sum()
        out[1] += tail.sum() * _weights(full, 1, x.device)[0]
    out[2] = cols.mul_(_weights(0, _ROW, x.device)).sum()
    return out


def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n, 3) int64 on CPU: one fingerprint per tensor, computed where each tensor lives (one
    device-to-host copy per device, not per tensor)."""
    if not tensors:
        return torch.zeros(0, 3, dtype=torch.int64)
    prints = [fingerprint(t) for t in tensors]
    if len({p.device for p in prints}) == 1:
        return torch.stack(prints).cpu()
    return torch.stack([p.cpu() for p in prints])
