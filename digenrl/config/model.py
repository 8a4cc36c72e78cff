"""The model sections: which family and checkpoint, LoRA, sampling, trained timesteps."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from digenrl.adapters import ADAPTERS
from digenrl.config.base import (
    MAX_BATCH,
    MAX_PIXELS,
    MAX_STEPS,
    _Section,
    on_off,
)

#: the tiny demo's LoRA targets: attention + the pooled-text / output-modulation path, so a tiny
#: model can map a colour word to a global colour shift (real-scale configs list the standard
#: attention / FFN modules of their family)
TINY_FLUX_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "text_embedder.linear_1",
    "text_embedder.linear_2",
    "norm_out.linear",
    "proj_out",
]


# --------------------------------------------------------------------------------------- model
class LoraConfig(_Section):
    rank: int = Field(8, gt=0, le=MAX_BATCH)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] | None = Field(
        default_factory=lambda: list(TINY_FLUX_LORA_TARGETS),
        description=(
            "module-name suffixes (default: the tiny FLUX demo's); null = the adapter's default list"
        ),
    )
    init_seed: int = 0


class ModelConfig(_Section):
    adapter: str = "flux"
    preset: str | None = Field(
        "tiny", description="tiny random-init preset of the real classes (no download)"
    )
    pretrained: Path | None = Field(None, description="local diffusers checkpoint directory")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    height: int = Field(32, gt=0, le=MAX_PIXELS)
    width: int = Field(32, gt=0, le=MAX_PIXELS)
    frames: int | None = Field(None, gt=0, le=MAX_STEPS, description="video models only")
    lora: LoraConfig | None = Field(default_factory=LoraConfig, description="null = full fine-tuning")
    max_text_len: int = Field(16, gt=0, le=MAX_BATCH)
    prompt_cache: int = Field(
        512,
        ge=0,
        description="distinct prompts whose embeddings a worker keeps "
        "(each encoded once per run, kept on the CPU); 0 = encode every time",
    )
    train_experts: Literal["both", "high_noise", "low_noise"] = Field(
        "both",
        description="a model of two experts by noise level (wan22 T2V-A14B): train both, or only the "
        "high-noise `transformer` / the low-noise `transformer_2` (the other stays frozen)",
    )
    offload_text_encoders: bool = Field(
        False,
        description="a checkpoint's text encoders stay on the CPU and "
        "move to the device only to encode prompts",
    )
    cudnn_attention: bool = Field(
        False,
        description="let PyTorch's attention pick cuDNN's kernel on CUDA (off: its backward failed on the "
        "first train step at FLUX width in bf16 on an H200, torch 2.11 + CUDA 13.0; docs/real_scale.md)",
    )

    @field_validator("adapter")
    @classmethod
    def _known_adapter(cls, name: str) -> str:
        if name not in ADAPTERS:
            raise ValueError(f"unknown adapter '{name}' (available: {', '.join(sorted(ADAPTERS))})")
        return name

    @model_validator(mode="before")
    @classmethod
    def _pretrained_replaces_preset(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("pretrained") is not None
            and data.get("preset", "tiny") == "tiny"
        ):
            data = {**data, "preset": None}  # a checkpoint replaces the default tiny preset
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.preset is None) == (self.pretrained is None):
            raise ValueError(
                "set exactly one of model.preset (tiny, random init) or model.pretrained (local path)"
            )
        return self


# ------------------------------------------------------------------------------------ sampling
class SamplingConfig(_Section):
    steps: int = Field(8, gt=0, le=MAX_STEPS, description="denoising steps during RL rollouts")
    eval_steps: int = Field(16, gt=0, le=MAX_STEPS)
    shift: float | None = Field(
        None, gt=0, description="fixed sigma shift; None = the model's own (FLUX/Qwen: dynamic mu)"
    )
    guidance: float = Field(3.5, ge=0, description="guidance scale in the model's own style")
    guidance_2: float | None = Field(
        None,
        ge=0,
        description="guidance scale of the low-noise expert (wan22 T2V-A14B, WanPipeline's "
        "guidance_scale_2); null: sampling.guidance",
    )
    eval_guidance: float | None = Field(
        None,
        ge=0,
        description="guidance scale of evaluation only (null: sampling.guidance); e.g. CFG at eval after "
        "CFG-free diffusion_nft training",
    )
    negative_prompt: str = ""
    sde: Literal["flow_grpo", "dance_grpo", "cps"] = "flow_grpo"
    noise_level: float = Field(1.0, ge=0, description="eta; 0 = deterministic ODE (Euler) sampling")
    cfg_batching: Literal["auto", "batched", "sequential"] = Field(
        "auto",
        description=(
            "two-pass CFG (Wan, Qwen-Image): batched = one forward of 2B (training holds both passes' "
            "activations); sequential = two forwards of B (training backpropagates one pass at a time); auto "
            "= batched where the memory model says it fits the device, else sequential (sequential on "
            "devices of unknown memory)"
        ),
    )
    vae_tiling: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "decode with the VAE's spatial (and, HunyuanVideo, temporal) tiles; auto = on when one decoded "
            "sample (height x width x frames) exceeds the memory model's tile (4 Mpx). Decoding is always "
            "one sample at a time"
        ),
    )

    @field_validator("vae_tiling", mode="before")
    @classmethod
    def _switch(cls, value):
        return on_off(value)


# ----------------------------------------------------------------------------------- algorithm
class TimestepConfig(_Section):
    mode: Literal["fraction", "random", "window"] = "fraction"
    fraction: float = Field(
        0.99, gt=0, le=1, description="fraction: first floor(N*f) steps; random: floor((N-1)*f) per sample"
    )
    window: int = Field(
        2, gt=0, le=MAX_STEPS, description="window mode: SDE steps per trajectory (ODE elsewhere)"
    )
    window_shift_every: int = Field(
        0,
        ge=0,
        description="0 = random window start (Flow-GRPO-Fast); K = slide by one every K iterations (MixGRPO)",
    )
    window_range: tuple[float, float] = Field(
        (0.0, 0.5),
        description=(
            "window mode: [start, end) as fractions of sampling.steps that the window stays inside; "
            "(0, 0.5) = the first half, as flow_grpo-Fast's (0, N//2); the last step is never inside"
        ),
    )

    @field_validator("window_range")
    @classmethod
    def _ordered_fractions(cls, r: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= r[0] < r[1] <= 1:
            raise ValueError(
                f"must be [start, end] fractions of the steps with 0 <= start < end <= 1 (got {list(r)})"
            )
        return r
