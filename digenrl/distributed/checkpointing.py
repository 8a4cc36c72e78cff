"""Activation checkpointing per transformer block.

Each block's ``forward`` is replaced (on the instance, so parameter names and state-dict keys
do not change) by one that runs it under non-reentrant ``torch.utils.checkpoint``: autograd then
keeps only the block's inputs and recomputes the block's internals during backward. Apply it
before FSDP2 (torchtitan's order): FSDP2's hooks sit around the module call, so the parameters
are unsharded again when backward recomputes the block.
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint
from torch import nn

from digenrl.distributed.blocks import transformer_blocks


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # sampling: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


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
