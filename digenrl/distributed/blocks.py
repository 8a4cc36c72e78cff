"""The repeated transformer blocks of a diffusers transformer: the unit FSDP2 shards and
activation checkpointing recomputes.

FLUX and HunyuanVideo: ``transformer_blocks`` then ``single_transformer_blocks``; Wan2.1:
``blocks``; Qwen-Image: ``transformer_blocks``; Z-Image: ``noise_refiner``,
``context_refiner``, ``layers``; a model of two experts (Wan2.2 A14B,
adapters/experts.py): each expert's blocks, high-noise expert first. LoRA added with
``add_adapter`` leaves these attributes in place (peft injects into the blocks' linear layers).
"""

from __future__ import annotations

from torch import nn

BLOCK_LISTS = (
    "transformer_blocks",
    "single_transformer_blocks",
    "blocks",
    "noise_refiner",  # Z-Image: the image and caption refiners, then the joint layers
    "context_refiner",
    "layers",
)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """Every block of the model's block lists, in forward order; raises on a model without any."""
    blocks: list[nn.Module] = []
    for part in model.experts() if hasattr(model, "experts") else [model]:
        for name in BLOCK_LISTS:
            group = getattr(part, name, None)
            if isinstance(group, nn.ModuleList):
                blocks.extend(group)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has none of the block lists {BLOCK_LISTS}")
    return blocks
