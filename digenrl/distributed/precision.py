"""fp32 master weights, bf16 compute.

Details: docs/modules.md, `digenrl.distributed.precision`.
"""

from __future__ import annotations

import torch
from torch import nn


def fp32_master(model: nn.Module) -> int:
    """Cast every trainable floating parameter of ``model`` to fp32 in place (frozen ones keep
    their dtype); returns how many parameters were cast. Call it before building the optimizer."""
    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
            cast += 1
    return cast


def trained_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.requires_grad}
