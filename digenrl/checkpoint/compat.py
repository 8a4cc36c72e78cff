"""What a checkpoint's ``state.json`` says (:class:`CheckpointState`) and whether the checkpoint fits
a model: the config fields that fix the weights' shapes and meaning, and the model's signature; a
misfit is refused naming every difference."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from digenrl.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model."""


@dataclass
class CheckpointState:
    """What ``state.json`` says about a checkpoint."""

    path: Path
    iteration: int  # iterations completed; a resumed run continues at this iteration
    version: int  # policy version (optimizer steps taken)
    lora: bool
    signature: dict  # adapter.model_signature()
    compat: dict  # the config fields that fix the weights' shapes and meaning
    files: dict[str, int]  # file name -> size in bytes
    extra: dict = field(default_factory=dict)  # driver counters (the engine's, say)
    optimizer_format: str = "torch"  # "torch": optimizer.pt; "dcp": dcp/ (sharded)

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def run_dir(self) -> Path | None:
        """The run directory that holds this checkpoint (RUN/checkpoints/iter-N), if it is one."""
        return self.path.parent.parent if self.path.parent.name == "checkpoints" else None


def torch_load(f: Path):
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  (pickle / zip errors of a damaged file)
        raise CheckpointError(f"checkpoint: {f} is corrupt or unreadable ({type(exc).__name__})") from None


def compat_fields(policy) -> dict:
    """The config that fixes the weights' shapes and meaning: a checkpoint only fits a model that agrees."""
    m = policy.cfg.model
    out = {
        "model.adapter": m.adapter,
        "model.preset": m.preset,
        "model.pretrained": str(m.pretrained) if m.pretrained is not None else None,
        "model.lora": "lora" if policy.lora else "full fine-tuning",
        "model.height": m.height,
        "model.width": m.width,
        "model.frames": m.frames,
    }
    if policy.lora:
        out.update(
            {
                "model.lora.rank": m.lora.rank,
                "model.lora.alpha": m.lora.alpha,
                "model.lora.targets": sorted(policy.lora_targets),
            }
        )
    return out


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_compatible(state: CheckpointState, policy) -> None:
    """Refuse a checkpoint of another model / adapter / LoRA layout / resolution, naming every difference."""
    now = _jsonable(compat_fields(policy))
    diffs = [
        f"{k}: checkpoint {state.compat.get(k)!r}, config {now.get(k)!r}"
        for k in sorted(set(now) | set(state.compat))
        if state.compat.get(k) != now.get(k)
    ]
    if not diffs:  # same config fields but a different network (another diffusers version, say)
        old, new = _flat(state.signature), _flat(_jsonable(policy.adapter.model_signature()))
        diffs = [
            f"model signature {k}: checkpoint {old.get(k)!r}, model {new.get(k)!r}"
            for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)
        ]
    if diffs:
        more = f" (+{len(diffs) - 4} more)" if len(diffs) > 4 else ""
        raise CheckpointError(
            f"checkpoint {state.path} does not fit this config: {'; '.join(diffs[:4])}{more}"
        )
