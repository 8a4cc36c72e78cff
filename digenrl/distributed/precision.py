"""fp32 master weights, bf16 compute.

A bf16 parameter updated by AdamW at a small learning rate loses most of its updates: an update
smaller than half a bf16 ulp of the weight rounds away (one step at lr 1e-5 changed ~3.5% of
the elements of a bf16 model, measured here). So every trained parameter is kept in fp32 and the
optimizer steps in fp32; compute runs in bf16 either through ``torch.autocast`` (unsharded:
the adapter's ``autocast()``) or through FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``
which casts the all-gathered parameters (sharded).
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
