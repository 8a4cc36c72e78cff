"""LoRA through peft on the adapter's transformer, with every target checked and every load verified.

peft matches target names as suffixes and silently ignores names that match nothing as long as one
matches, and loading a state dict reports unexpected keys without raising (docs/architecture.md): both would
train less than asked without a word, so both are checked here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from digenrl.config.model import LoraConfig
from digenrl.errors import UserError, WeightSyncError


def matching_modules(model: nn.Module, target: str) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and (n == target or n.endswith("." + target))
    ]


def apply_lora(transformer: nn.Module, cfg: LoraConfig, default_targets: tuple[str, ...]) -> list[str]:
    """Add a LoRA adapter (diffusers/peft ``add_adapter``); returns the targets used."""
    from peft import LoraConfig as PeftLoraConfig

    targets = list(cfg.targets or default_targets)
    missing = [t for t in targets if not matching_modules(transformer, t)]
    if missing:
        raise UserError(
            f"model.lora.targets: {missing} match no linear module of {type(transformer).__name__}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        transformer.add_adapter(
            PeftLoraConfig(
                r=cfg.rank,
                lora_alpha=cfg.alpha,
                lora_dropout=cfg.dropout,
                target_modules=targets,
                init_lora_weights=True,
            )
        )
    for p in transformer.parameters():  # trainable LoRA weights live in fp32 (autocast runs the base in bf16)
        if p.requires_grad:
            p.data = p.data.float()
    return targets


def lora_state_dict(transformer: nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {
        k: full_tensor(v).detach().cpu().clone() for k, v in get_peft_model_state_dict(transformer).items()
    }


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank of the mesh calls it, in the
    same order), or ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def checksum(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_lora_state_dict(
    transformer: nn.Module, state: dict[str, torch.Tensor], expected_checksum: str | None = None
):
    """Load LoRA weights and verify: no unexpected or missing keys, checksum equal after load."""
    from peft.utils import set_peft_model_state_dict

    result = set_peft_model_state_dict(transformer, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in (getattr(result, "missing_keys", []) or []) if "lora_" in k]
    if unexpected or missing:
        raise WeightSyncError(
            f"LoRA load mismatch: {len(unexpected)} unexpected keys {unexpected[:3]}, "
            f"{len(missing)} missing keys {missing[:3]}"
        )
    if expected_checksum is not None:
        got = checksum(lora_state_dict(transformer))
        if got != expected_checksum:
            raise WeightSyncError(
                f"LoRA checksum mismatch after load: {got[:12]} != {expected_checksum[:12]}"
            )


def save_lora(adapter, directory: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Save in the standard diffusers format (``pytorch_lora_weights.safetensors``) through the family's
    pipeline class, so ``Pipeline.load_lora_weights(directory)`` takes it; ``state``: the LoRA tensors
    when already gathered (:func:`lora_state_dict`)."""
    import diffusers

    # a pipeline without a LoRA loader (HunyuanVideo-1.5) names one that writes the same file format
    pipeline_cls = getattr(diffusers, getattr(adapter, "lora_pipeline_class", None) or adapter.pipeline_class)
    directory.mkdir(parents=True, exist_ok=True)
    # the adapter's own rank / alpha / targets travel in the file's metadata: without them
    # load_lora_weights guesses alpha = rank and scales the trained update by rank/alpha
    peft_cfg = adapter.transformer.peft_config["default"]
    metadata = {
        "r": peft_cfg.r,
        "lora_alpha": peft_cfg.lora_alpha,
        "lora_dropout": peft_cfg.lora_dropout,
        "target_modules": sorted(peft_cfg.target_modules),
        "bias": "none",
    }
    state = state if state is not None else lora_state_dict(adapter.transformer)
    for weight_name, part in adapter.lora_files(state).items():  # one file per trained expert
        pipeline_cls.save_lora_weights(
            directory,
            transformer_lora_layers=part,
            weight_name=weight_name,
            transformer_lora_adapter_metadata=metadata,
        )
    return directory / "pytorch_lora_weights.safetensors"
