"""Reading a checkpoint back: its state (``state.json``), its weights into a policy (verified), the
RNG states, the EMA average; refused with one line when it does not fit the model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from digenrl.checkpoint.compat import (
    CheckpointError,
    CheckpointState,
    check_compatible,
    torch_load,
)
from digenrl.checkpoint.optimizer import (
    OPTIMIZER_FILE,
    TRAINER_ONLY,
    check_holds_optimizer,
    restore_optimizer,
)
from digenrl.checkpoint.store import (
    EMA_FILE,
    FORMAT,
    FULL_FILE,
    LORA_FILE,
    OLD_POLICY_FILE,
    STATE_FILE,
    find_checkpoint,
)
from digenrl.errors import WeightSyncError


def read_state(path: Path, unchecked: tuple[str, ...] = ()) -> CheckpointState:
    """Read and check ``state.json`` and the sizes of the files it lists (a truncated file is
    refused), except those named in ``unchecked`` (files, or top-level directories, the reader will
    not open)."""
    path = Path(path)
    try:
        raw = json.loads((path / STATE_FILE).read_text())
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        fmt = raw["format"]
        state = CheckpointState(
            path=path,
            iteration=int(raw["iteration"]),
            version=int(raw["version"]),
            lora=bool(raw["lora"]),
            signature=raw["model_signature"],
            compat=raw["compat"],
            files={str(k): int(v) for k, v in raw["files"].items()},
            extra=raw.get("extra", {}),
            optimizer_format=str(raw.get("optimizer_format", "torch")),
        )
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {path} is incomplete (no {STATE_FILE})") from None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise CheckpointError(
            f"checkpoint: {path / STATE_FILE} is corrupt (not a DigenRL checkpoint state)"
        ) from None
    if fmt != FORMAT:
        raise CheckpointError(f"checkpoint: {path} has format {fmt}, this DigenRL reads format {FORMAT}")
    for name, size in state.files.items():
        if name in unchecked or name.split("/")[0] in unchecked:
            continue
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint: {path} is corrupt: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint: {path} is corrupt: {name} has {f.stat().st_size} bytes, "
                f"expected {size} (truncated or overwritten)"
            )
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------- load
def read_weights(path: Path, lora: bool, adapter=None) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as the policy names them (LoRA: peft keys, without diffusers' prefix;
    with ``adapter``, every LoRA file it writes, e.g. one per expert, joined by ``lora_from_files``)."""
    if not lora:
        return read_safetensors(Path(path) / FULL_FILE)
    names = adapter.lora_weight_names if adapter is not None else (LORA_FILE,)
    files = {  # a model of two experts may have trained one: its other file is absent
        name: {k.removeprefix("transformer."): v for k, v in read_safetensors(Path(path) / name).items()}
        for name in names
        if len(names) == 1 or (Path(path) / name).is_file()
    }
    return adapter.lora_from_files(files) if adapter is not None else files[LORA_FILE]


def load_checkpoint(path: Path, policy, *, optimizer: bool = True, rng: bool = True) -> CheckpointState:
    """Restore weights (verified), version, optimizer state and RNG states into ``policy``.

    ``path`` is a checkpoint or a run directory (its latest complete checkpoint). Refuses, before
    touching the policy, a checkpoint that is corrupt or was written for another model. The
    optimizer keeps its state but takes lr / betas / weight decay from the policy's current config
    (so a resumed run may change them). Returns the checkpoint's :class:`CheckpointState`.
    """
    loads_optimizer = optimizer and policy.optimizer is not None
    state = read_state(find_checkpoint(path), unchecked=() if loads_optimizer else TRAINER_ONLY)
    check_compatible(state, policy)
    if state.lora != policy.lora:  # also caught by compat; kept for engine callers that skip it
        raise CheckpointError(f"checkpoint {state.path}: LoRA checkpoint vs full fine-tuning model")
    weights = read_weights(state.path, state.lora, policy.adapter)
    opt_state = None
    if loads_optimizer:
        check_holds_optimizer(state)
        if state.optimizer_format == "torch":
            opt_state = torch_load(state.path / OPTIMIZER_FILE)
    rngs = torch_load(state.path / "rng.pt") if rng else None
    raw = json.loads((state.path / STATE_FILE).read_text())
    try:
        policy.load_weights(weights, state.version, expected_checksum=raw.get("weights_checksum"))
    except WeightSyncError as exc:
        raise CheckpointError(f"checkpoint {state.path}: weights do not load cleanly ({exc})") from None
    if loads_optimizer:
        restore_optimizer(state, policy, opt_state)
    if getattr(policy, "ema", None) is not None:  # resume the average, or start it here if none was kept
        if EMA_FILE in state.files:
            try:
                policy.ema.load(
                    read_safetensors(state.path / EMA_FILE), int(raw.get("ema", {}).get("steps", 0))
                )
            except ValueError as exc:
                raise CheckpointError(
                    f"checkpoint {state.path}: {EMA_FILE} does not fit this model ({exc})"
                ) from None
        else:
            policy.ema.reset()
    if getattr(policy, "old", None) is not None:  # diffusion_nft: resume the old policy, or restart it
        steps = state.iteration * policy.cfg.train.optimizer_steps  # at the weights if none was kept
        if OLD_POLICY_FILE in state.files:
            try:
                policy.old.load(read_safetensors(state.path / OLD_POLICY_FILE), steps)
            except ValueError as exc:
                raise CheckpointError(
                    f"checkpoint {state.path}: {OLD_POLICY_FILE} does not fit this model ({exc})"
                ) from None
        else:
            policy.old.reset(steps)
    if rngs is not None:
        set_rng_state(rngs)
    return state


def load_export(path: Path, policy) -> None:
    """Load a weights export (a run's ``final/``: LoRA in diffusers' format, or the full transformer)
    into ``policy``; refused with one line when it does not fit the model."""
    lora = (Path(path) / LORA_FILE).is_file()
    if lora != policy.lora:
        held, wants = ("LoRA", "full weights (model.lora: null)") if lora else ("full weights", "a LoRA")
        raise CheckpointError(f"checkpoint: {path} holds {held}, the config trains {wants}")
    try:
        policy.load_weights(read_weights(path, lora, policy.adapter), version=0)
    except (WeightSyncError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint: {path} does not fit this config's model ({str(exc).splitlines()[0][:200]})"
        ) from None


def read_safetensors(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(f)
    except Exception as exc:  # noqa: BLE001  (safetensors raises its own error types)
        raise CheckpointError(f"checkpoint: {f} is corrupt or unreadable ({type(exc).__name__})") from None


def use_ema_weights(path, policy) -> dict | None:
    """Load checkpoint ``path``'s EMA weights (if it holds any) into ``policy``'s trained parameters,
    after :func:`load_checkpoint`. Returns the average's settings (``decay``,
    ``every``, ``warmup``, ``steps``), or None when the checkpoint holds no average."""
    state = read_state(find_checkpoint(path))
    if EMA_FILE not in state.files:
        return None
    average = read_safetensors(state.path / EMA_FILE)
    params = policy.named_params
    if set(average) != set(params):
        raise CheckpointError(f"checkpoint {state.path}: {EMA_FILE} does not fit this model")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(average[name].to(p.device, p.dtype))
    return json.loads((state.path / STATE_FILE).read_text()).get("ema", {})
