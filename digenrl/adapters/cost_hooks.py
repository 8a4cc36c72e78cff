"""What the planner reads of a model family without building it: its published shapes, token counts,
FLOPs, width, blocks and guidance passes, from the component configs alone (classmethods every
adapter inherits). Details: docs/modules.md, `digenrl.adapters.base`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from digenrl.config.model import ModelConfig


@dataclass(frozen=True)
class Tokens:
    """One sample as the transformer sees it."""

    x: int  # image / video tokens per sample
    text: int  # text tokens per sample
    latent_elements: int  # fp32 latent numbers per sample (one denoising state)
    pixels: int  # decoded pixels per sample (x frames)


@dataclass(frozen=True)
class PublishedModel:
    """A family's reference checkpoint as published (the numbers of its diffusers ``config.json``
    files): what the planner costs when a real-scale config's checkpoint is not on this machine."""

    label: str
    transformer: dict  # transformer/config.json
    vae: dict  # the vae/config.json entries that set its compression
    vae_params: float
    vae_decode_flops_per_px: float  # VAE decoder FLOPs per output pixel (per frame), rough, from its widths
    text_encoder_params: float  # the text encoder(s) the rollout side holds


def hidden_size(transformer_config: dict) -> int:
    """The transformer's model width d (every supported family: heads x head dim)."""
    return transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"]


class CostHooks:
    """The adapter's cost hooks: a family sets ``published`` and overrides what its configs need."""

    published: PublishedModel  # the family's reference model

    @classmethod
    def published_model(cls, model: ModelConfig) -> PublishedModel:
        """The published reference a config without a local checkpoint is costed as (a family with
        several published sizes picks one from the configured checkpoint's directory name)."""
        return cls.published

    @classmethod
    def experts_held(cls, model: ModelConfig) -> int:
        """Transformers the model holds (a mixture of experts by noise level holds each in memory)."""
        return 1

    @classmethod
    def experts_trained(cls, model: ModelConfig) -> int:
        """Of :meth:`experts_held`, the ones that train (the others stay frozen)."""
        return 1

    @classmethod
    def vae_factors(cls, vae_config: dict) -> tuple[int, int]:
        """(spatial, temporal) compression of a VAE with this config."""
        raise NotImplementedError

    @classmethod
    def latent_shape_for(
        cls, model: ModelConfig, transformer_config: dict, vae_config: dict
    ) -> tuple[int, ...]:
        """One sample's latent shape (as :meth:`latent_shape`) from the component configs."""
        raise NotImplementedError

    @classmethod
    def sequence_tokens(cls, transformer_config: dict, latent_shape: tuple[int, ...]) -> int:
        """Image / video tokens the transformer makes of one sample's latents."""
        raise NotImplementedError

    @classmethod
    def tokens(cls, model: ModelConfig, transformer_config: dict, vae_config: dict) -> Tokens:
        shape = cls.latent_shape_for(model, transformer_config, vae_config)
        return Tokens(
            cls.sequence_tokens(transformer_config, shape),
            model.max_text_len,
            math.prod(shape),
            model.height * model.width * (model.frames or 1),
        )

    @classmethod
    def forward_flops(cls, transformer_config: dict, tokens: Tokens) -> float:
        """FLOPs of one transformer pass for one sample (one guidance branch): 2 x the multiply-adds of
        every linear layer per token, ``4 n_q n_kv d`` per attention, the per-sample modulation layers;
        norms, RoPE and elementwise work left out."""
        raise NotImplementedError

    @classmethod
    def width(cls, transformer_config: dict) -> int:
        """The model width d (the planner's activation and text-embedding sizes)."""
        return hidden_size(transformer_config)

    @classmethod
    def blocks(cls, transformer_config: dict) -> int:
        """Transformer blocks one pass runs (activation memory, per-block costs)."""
        return transformer_config["num_layers"] + transformer_config.get("num_single_layers", 0)

    @classmethod
    def attention_flops(cls, transformer_config: dict, tokens: Tokens) -> float:
        """The score / value products of one pass: joint attention over image + text tokens in every block."""
        c = transformer_config
        n = tokens.x + tokens.text
        return (c["num_layers"] + c.get("num_single_layers", 0)) * 4 * n * n * hidden_size(c)

    @classmethod
    def guidance_passes(cls, guidance: float) -> int:
        """Transformer passes per denoising step at this guidance scale (2 for two-pass CFG)."""
        return 1

    @classmethod
    def passes_for(cls, transformer_config: dict, guidance: float) -> int:
        """:meth:`guidance_passes` of this transformer config (FLUX.2: [dev] embeds the guidance)."""
        return cls.guidance_passes(guidance)
