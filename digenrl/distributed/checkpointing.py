"""Activation checkpointing per transformer block.

Details: docs/modules.md, `digenrl.distributed.checkpointing`.
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint
from torch import nn

from digenrl.distributed.blocks import transformer_blocks


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # sampling: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    # keyword tensors travel as positional ones, so autograd saves them (version-checked) rather
    # than the checkpoint holding them by reference (diffusers calls FLUX blocks by keyword)
    names, n = list(kwargs), len(args)

    def run(*flat):
        return forward(*flat[:n], **dict(zip(names, flat[n:])))

    return torch.utils.checkpoint.checkpoint(run, *args, *kwargs.values(), use_reentrant=False)


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint every transformer block of ``model``; returns the number of blocks wrapped.
    Idempotent: a block already wrapped is left alone."""
    wrapped = 0
    for block in transformer_blocks(model):
        if getattr(block, "_digenrl_checkpointed", False):
            continue
        block.forward = functools.partial(_checkpointed, block.forward)
        block._digenrl_checkpointed = True
        wrapped += 1
    return wrapped


def is_checkpointed(model: nn.Module) -> bool:
    return all(getattr(b, "_digenrl_checkpointed", False) for b in transformer_blocks(model))
