"""Checkpoints by path with ``torch.distributed.checkpoint`` (DCP).

Details: docs/modules.md, `digenrl.distributed.dcp`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)


def _options(trainable_only: bool) -> StateDictOptions:
    # without the frozen base, a load is partial by design (the base comes from the pretrained files)
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def save_sharded(
    path: Path | str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    trainable_only: bool = False,
) -> None:
    """Every rank of the default group calls it; each writes its own shards under ``path``.
    ``trainable_only``: leave frozen parameters out (LoRA: the base comes from the pretrained
    checkpoint, not from here)."""
    model_sd, optim_sd = get_state_dict(
        model, optimizer if optimizer is not None else [], options=_options(trainable_only)
    )
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.save(state, checkpoint_id=str(path))


def load_sharded(
    path: Path | str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    trainable_only: bool = False,
) -> None:
    """Restore ``model`` (and ``optimizer``) in place from ``path``, resharding to this world."""
    opts = _options(trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [], options=opts)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=opts,
    )


def save_optimizer(path: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer state alone (keyed by parameter name): every rank of the model's shard group
    writes its own shards under ``path``, nothing is gathered (HSDP: one replica group saves, its
    ranks hold every shard). A trainer checkpoint keeps the weights apart, gathered in the ordinary
    format that eval, rollout workers and diffusers read."""
    dcp.save(
        {"optim": get_optimizer_state_dict(model, optimizer)},
        checkpoint_id=str(path),
        process_group=_shard_group(model),
    )


def _shard_group(model: nn.Module):
    """The process group the model is sharded over (HSDP: this rank's shard group, one replica);
    None (the default group) for a model that is not sharded."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    return None


def load_optimizer(path: Path | str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore :func:`save_optimizer`'s state in place, resharded to this world: FSDP2 ranks of any
    count (a collective over the model's shard group; HSDP: each replica loads its own), or a plain
    model in a process without a group."""
    import warnings

    state = {"optim": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():  # without a group DCP warns that it loads in one process: intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), process_group=_shard_group(model))
    set_optimizer_state_dict(model, optimizer, state["optim"])


def load_full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """An unsharded optimizer state (keyed by parameter name, full tensors) into a sharded
    optimizer: each rank keeps its own shard of every tensor."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


class _RecordingReader(dcp.FileSystemReader):
    """A file-system reader that remembers which checkpoint items it was asked to read."""

    def __init__(self, path):
        super().__init__(path)
        self.read_items: list[str] = []

    def read_data(self, plan, planner):
        self.read_items.extend(item.storage_index.fqn for item in plan.items)
        return super().read_data(plan, planner)


def load_model_tensors(path: Path | str, targets: dict[str, torch.Tensor]) -> list[str]:
    """Rollout side: read only ``model.<name>`` for each name of ``targets`` (the worker's own
    tensors, filled in place; e.g. only the LoRA ones) from a DCP checkpoint, without a process
    group. Returns the checkpoint items read (never an ``optim.*`` one)."""
    reader = _RecordingReader(str(path))
    state = {"model": dict(targets)}
    dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
    for name, tensor in state["model"].items():  # DCP loads in place; copy in case it replaced one
        if tensor is not targets[name]:
            targets[name].copy_(tensor)
    return reader.read_items
