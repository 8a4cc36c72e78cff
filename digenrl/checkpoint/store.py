"""Writing checkpoints: ``checkpoints/iter-NNNNNN/`` with the weights (LoRA in the diffusers / peft
format, or full safetensors), optimizer, RNG states, counters and config, written into a staging
directory and renamed into place (atomic), the newest ``output.keep_last`` kept; and finding them
(a run directory's latest complete one). Reading them back: :mod:`digenrl.checkpoint.load`."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from digenrl.checkpoint.compat import (
    CheckpointError,
    compat_fields,
)
from digenrl.checkpoint.optimizer import (
    DCP_DIR,
    OPTIMIZER_FILE,
    StagedDir,
    save_optimizer_sharded,
)
from digenrl.distributed.fsdp import is_sharded
from digenrl.policy.lora import checksum, save_lora

FORMAT = 1  # bump when the layout changes; older formats are refused with a message
LORA_FILE = "pytorch_lora_weights.safetensors"
FULL_FILE = "transformer.safetensors"
EMA_FILE = "ema.safetensors"
OLD_POLICY_FILE = "old_policy.safetensors"  # diffusion_nft: the old policy (trained-parameter names)
STATE_FILE = "state.json"
_NAME = re.compile(r"^iter-(\d{6,})$")


def checkpoint_name(iteration: int) -> str:
    return f"iter-{iteration:06d}"


# ---------------------------------------------------------------------------------------- finding
def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run directory, oldest first (``.tmp-`` and marker-less dirs skipped)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _NAME.match(p.name)) and p.is_dir() and (p / STATE_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint: ``path`` itself if it is one, else the latest under
    ``path/checkpoints`` (a run directory) or under ``path`` (a ``checkpoints`` directory)."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path) or (list_checkpoints(path.parent) if path.name == "checkpoints" else [])
    return found[-1] if found else None


def find_checkpoint(path: Path) -> Path:
    """Like :func:`latest_checkpoint`, but a user error (naming what is wrong) when there is none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint: {path} not found")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: {path} is not a directory")
    found = latest_checkpoint(path)
    if found is not None:
        return found
    if _NAME.match(path.name) or path.name.startswith(".tmp-") or (path / OPTIMIZER_FILE).exists():
        raise CheckpointError(f"checkpoint: {path} is incomplete (no {STATE_FILE}: its write did not finish)")
    if is_weights_export(path):
        raise CheckpointError(
            f"checkpoint: {path} is a weights export (a run's final/: weights only, no {STATE_FILE}, no "
            "optimizer); --resume needs the run directory or one of its checkpoints/iter-*; "
            "`digenrl eval --checkpoint` reads an export"
        )
    held = sorted(p.name for p in path.iterdir())[:5] if path.is_dir() else []
    raise CheckpointError(
        f"checkpoint: no complete checkpoint in {path}: it is neither a checkpoint ({STATE_FILE}), a run "
        f"directory (checkpoints/iter-*/{STATE_FILE}) nor a weights export ({LORA_FILE} or {FULL_FILE}); "
        "it holds " + (", ".join(held) + (", ..." if len(held) == 5 else "") if held else "nothing")
    )


def is_weights_export(path: Path) -> bool:
    """A run's ``final/`` (or any folder of the same files): the trained weights -- a LoRA in diffusers'
    format, or the full transformer -- without a checkpoint's state, optimizer or RNG."""
    path = Path(path)
    return (
        path.is_dir()
        and not (path / STATE_FILE).exists()
        and any((path / f).is_file() for f in (LORA_FILE, FULL_FILE))
    )


# ---------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# ---------------------------------------------------------------------------------------- save
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path, policy, iteration: int, cfg=None, keep_last: int | None = None, extra: dict | None = None
) -> Path:
    """Write ``run_dir/checkpoints/iter-NNNNNN`` atomically and keep the newest ``keep_last``.

    ``iteration`` is the number of iterations completed (the one a resumed run starts at); ``cfg``
    defaults to the policy's; ``extra`` (JSON) is stored for the driver, e.g. the engine's counters.
    """
    return commit_checkpoint(
        run_dir, iteration, lambda tmp: write_checkpoint(tmp, policy, iteration, cfg, extra), keep_last
    )


def write_checkpoint(
    directory: Path | None,
    policy,
    iteration: int,
    cfg=None,
    extra: dict | None = None,
    optimizer_dir: Path | None = None,
    where: str = "this node",
) -> None:
    """The checkpoint's files into an existing (empty) ``directory``; ``state.json`` last.

    A sharded (FSDP2) policy: every rank of the group calls it (the weights and the EMA are gathered,
    a collective) with the same ``optimizer_dir``, where each rank writes its own shards of the
    optimizer state (:func:`staging_dir`); only rank 0 passes a ``directory`` (the others write nothing)."""
    cfg = cfg or policy.cfg
    weights = policy.weights()  # gathered from the shards on a sharded policy
    ema = getattr(policy, "ema", None)
    average = ema.state() if ema is not None else None
    old = getattr(policy, "old", None)  # diffusion_nft's old policy, gathered like the EMA
    old_state = old.state() if old is not None else None
    trainer_files, fmt = {}, "torch"
    if policy.optimizer is not None and is_sharded(policy.adapter.transformer):
        if optimizer_dir is None:
            raise ValueError("a sharded policy's optimizer state is saved by every rank: pass optimizer_dir")
        trainer_files, fmt = save_optimizer_sharded(policy, Path(optimizer_dir), where), "dcp"
    if directory is None:
        return
    tmp = Path(directory)
    if policy.lora:
        save_lora(policy.adapter, tmp, weights)
    else:
        save_file(weights, tmp / FULL_FILE)
    if policy.optimizer is not None and fmt == "torch":
        torch.save(policy.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    if average is not None:
        save_file(average, tmp / EMA_FILE)
    if old_state is not None:
        save_file(old_state, tmp / OLD_POLICY_FILE)
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "config.yaml").write_text(cfg.dump_yaml())
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.name != STATE_FILE}
    files.update(trainer_files)
    state = {
        "format": FORMAT,
        "iteration": iteration,
        "version": policy.version,
        "lora": policy.lora,
        "weights_checksum": checksum(weights) if policy.lora else None,
        "optimizer_format": fmt,
        "compat": compat_fields(policy),
        "model_signature": policy.adapter.model_signature(),
        "files": files,
        "extra": extra or {},
    }
    if ema is not None:  # the average's settings and how many optimizer steps it has seen
        state["ema"] = {**ema.cfg.model_dump(), "steps": ema.steps}
    if old is not None:
        state["old_policy"] = {"steps": old.steps}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, default=str))


def checkpoint_files(
    policy,
    iteration: int,
    cfg=None,
    extra: dict | None = None,
    optimizer_dir: Path | None = None,
    lead: bool = True,
    where: str = "this node",
) -> dict[str, bytes | StagedDir]:
    """The checkpoint as file name -> bytes (a Ray worker hands these to the driver, which may run
    on another node, to :func:`save_checkpoint_files`). A sharded group: every rank calls it with the
    same ``optimizer_dir`` (its shards land there, by path; rank 0's answer names it as ``dcp``); the
    ranks other than rank 0 (``lead=False``) only join the gathers and return nothing."""
    if not lead:
        write_checkpoint(None, policy, iteration, cfg, extra, optimizer_dir, where)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), policy, iteration, cfg, extra, optimizer_dir, where)
        files: dict = {f.name: f.read_bytes() for f in Path(tmp).iterdir()}
    if json.loads(files[STATE_FILE])["optimizer_format"] == "dcp":
        files[DCP_DIR] = StagedDir(str(optimizer_dir))
    return files


def save_checkpoint_files(
    run_dir: Path, iteration: int, files: dict[str, bytes | StagedDir], keep_last: int | None = None
) -> Path:
    """:func:`checkpoint_files`' output written atomically as ``run_dir/checkpoints/iter-NNNNNN``
    (a :class:`StagedDir` moved in)."""
    if STATE_FILE not in files:
        raise ValueError(f"checkpoint files lack {STATE_FILE}")

    def fill(tmp: Path) -> None:
        for name, data in sorted(files.items(), key=lambda kv: kv[0] == STATE_FILE):  # state.json last
            if isinstance(data, StagedDir):
                shutil.move(data.path, tmp / name)
            else:
                (tmp / name).write_bytes(data)

    return commit_checkpoint(run_dir, iteration, fill, keep_last)


def commit_checkpoint(run_dir: Path, iteration: int, fill, keep_last: int | None = None) -> Path:
    """``fill(tmp)`` writes a checkpoint into ``checkpoints/.tmp-iter-NNNNNN``; every file is fsynced,
    ``state.json`` (the completion marker) last, and the directory renamed into place."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a crash mid-write: never a checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{DCP_DIR}-*"):  # shards of a checkpoint never committed (a stop, a crash)
        if (m := _NAME.match(stale.name.removeprefix(f".{DCP_DIR}-"))) and int(m.group(1)) < iteration:
            shutil.rmtree(stale, ignore_errors=True)
    name = checkpoint_name(iteration)
    tmp, final = root / f".tmp-{name}", root / name
    tmp.mkdir()
    fill(tmp)
    marker = tmp / STATE_FILE
    for f in sorted(tmp.iterdir()):
        if f != marker:
            _fsync(f)
    _fsync(marker)
    _fsync(tmp)
    if final.exists():  # re-saving the same iteration (a forked run): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    if keep_last:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final
