"""A trainer checkpoint's optimizer state, in either format, restored into either sharding.

Details: docs/modules.md, `digenrl.checkpoint.optimizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from digenrl.checkpoint.compat import CheckpointError, CheckpointState, torch_load
from digenrl.distributed import dcp
from digenrl.distributed.fsdp import is_sharded
from digenrl.errors import UserError, first_line

OPTIMIZER_FILE = "optimizer.pt"
DCP_DIR = "dcp"
TRAINER_ONLY = (OPTIMIZER_FILE, DCP_DIR)  # what only a trainer reads (never a rollout worker)


@dataclass(frozen=True)
class StagedDir:
    """A directory the trainer ranks already wrote by path (a sharded group's ``dcp/``): the commit
    moves it into the checkpoint instead of writing bytes."""

    path: str


def staging_dir(run_dir: Path, iteration: int) -> Path:
    """Where a sharded trainer group writes checkpoint ``iteration``'s ``dcp/`` before the commit
    (``checkpoints/`` is created, so a rank can tell it sees the run directory)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    return root / f".{DCP_DIR}-iter-{iteration:06d}"  # .dcp-<the checkpoint's name>


def save_optimizer_sharded(policy, directory: Path, where: str) -> dict[str, int]:
    """Every rank of a sharded group writes its shards of the optimizer state into ``directory``
    (DCP, nothing gathered); returns the files (``dcp/<name>`` -> size) once all are written."""
    if not directory.parent.is_dir():
        raise UserError(
            f"output.run_dir: {directory.parent} is not visible on {where}: a sharded trainer group "
            "writes its checkpoint shards by path (put the run directory where every node mounts it)"
        )
    dcp.save_optimizer(directory, policy.adapter.transformer, policy.optimizer)
    return {f"{DCP_DIR}/{f.name}": f.stat().st_size for f in sorted(directory.iterdir()) if f.is_file()}


def check_holds_optimizer(state: CheckpointState) -> None:
    if state.optimizer_format not in ("torch", "dcp"):
        raise CheckpointError(
            f"checkpoint: {state.path / 'state.json'} names an unknown optimizer_format "
            f"{state.optimizer_format!r}"
        )
    held = (
        OPTIMIZER_FILE in state.files
        if state.optimizer_format == "torch"
        else any(name.startswith(f"{DCP_DIR}/") for name in state.files)
    )
    if not held:
        raise CheckpointError(
            f"checkpoint {state.path} holds no optimizer state (written without an optimizer)"
        )


def restore_optimizer(state: CheckpointState, policy, saved: dict | None = None) -> None:
    """The checkpoint's optimizer state into ``policy.optimizer``, whichever format wrote it and
    however this policy is sharded: ``dcp/`` reshards to this world (a collective on a sharded
    group: every rank calls it); ``optimizer.pt`` (``saved``, read if None) loads as is, or, into a
    sharded policy, each rank keeps its shard. lr / betas / weight decay come from the policy's config
    (a resumed run may change them)."""
    check_holds_optimizer(state)
    net, opt = policy.adapter.transformer, policy.optimizer
    what = f"{DCP_DIR}/" if state.optimizer_format == "dcp" else OPTIMIZER_FILE
    try:
        if state.optimizer_format == "dcp":
            dcp.load_optimizer(state.path / DCP_DIR, net, opt)
        else:
            saved = saved if saved is not None else torch_load(state.path / OPTIMIZER_FILE)
            if is_sharded(net):
                dcp.load_full_optimizer(net, opt, _keyed_by_name(saved, net))
            else:
                opt.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError, IndexError, CheckpointException) as exc:
        raise CheckpointError(
            f"checkpoint {state.path}: {what} does not fit this model ({first_line(exc)})"
        ) from None
    t = policy.cfg.train
    for group in opt.param_groups:
        group.update(lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)


def _keyed_by_name(saved: dict, net) -> dict:
    """An ``optimizer.state_dict()`` (indexed by trained parameter) keyed by parameter name instead."""
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: s for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
    }
