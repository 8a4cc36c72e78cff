"""Stable Diffusion 3.5 (``SD3Transformer2DModel``, MMDiT / MMDiT-X): spatial latents, two-pass CFG.

Details: docs/modules.md, `digenrl.adapters.sd3`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from digenrl.adapters.base import Adapter, seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import PublishedModel, Tokens, hidden_size
from digenrl.adapters.guidance import TwoPassCFG
from digenrl.adapters.pixels import unit_range
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_text import HashTextEncoder
from digenrl.errors import UserError

#: CLIP's fixed token count, in front of T5's in SD3's joint text sequence
CLIP_TOKENS = 77

# MMDiT-X as SD3.5 Medium: qk RMS norm, a dual-attention block first; caption width = model width
TINY_TRANSFORMER = dict(
    sample_size=32,
    patch_size=2,
    in_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=16,
    caption_projection_dim=32,
    pooled_projection_dim=16,
    out_channels=4,
    pos_embed_max_size=32,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
)
# SD3's VAE layout (no quant convs, a shift and a scale) at 4x spatial compression
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(8, 16, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
# the SD3.5 checkpoints' scheduler_config.json
SD3_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=False)

_SD3_VAE = dict(block_out_channels=[128, 256, 512, 512], latent_channels=16)
_TEXT_ENCODERS = 123e6 + 695e6 + 4.76e9  # CLIP-L + CLIP-G (OpenCLIP bigG) + T5-XXL encoder

# stabilityai/stable-diffusion-3.5-medium and -large: transformer/config.json
SD35_MEDIUM = PublishedModel(
    label="SD3.5-Medium",
    transformer=dict(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=24,
        attention_head_dim=64,
        num_attention_heads=24,
        joint_attention_dim=4096,
        caption_projection_dim=1536,
        pooled_projection_dim=2048,
        out_channels=16,
        pos_embed_max_size=384,
        dual_attention_layers=list(range(13)),
        qk_norm="rms_norm",
    ),
    vae=_SD3_VAE,
    vae_params=83.8e6,
    vae_decode_flops_per_px=6.6e6,
    text_encoder_params=_TEXT_ENCODERS,
)
SD35_LARGE = PublishedModel(
    label="SD3.5-Large",
    transformer=dict(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=38,
        attention_head_dim=64,
        num_attention_heads=38,
        joint_attention_dim=4096,
        caption_projection_dim=2432,
        pooled_projection_dim=2048,
        out_channels=16,
        pos_embed_max_size=192,
        dual_attention_layers=[],
        qk_norm="rms_norm",
    ),
    vae=_SD3_VAE,
    vae_params=83.8e6,
    vae_decode_flops_per_px=6.6e6,
    text_encoder_params=_TEXT_ENCODERS,
)


class SD3Adapter(TwoPassCFG, Adapter):
    name = "sd3"
    # flow_grpo scripts/train_sd3.py: the joint attention's projections (not the MMDiT-X ``attn2``)
    default_lora_targets = (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    )
    pipeline_class = "StableDiffusion3Pipeline"
    transformer_class = "SD3Transformer2DModel"
    published = SD35_MEDIUM
    presets = {"tiny": (TINY_TRANSFORMER, TINY_VAE)}
    GENERATION_PIPE_PARTS = Adapter.GENERATION_PIPE_PARTS + ("text_encoder_3", "tokenizer_3")

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKL, SD3Transformer2DModel

        if preset != "tiny":
            raise UserError(f"model.preset: unknown preset '{preset}' for sd3 (available: tiny)")
        with seeded(1234):
            self.transformer = SD3Transformer2DModel(**TINY_TRANSFORMER)
            self.vae = AutoencoderKL(**TINY_VAE).eval()
        tcfg = self.transformer.config
        # one stand-in for the three encoders: token embeddings at T5's width, pooled at the CLIPs'
        self.text = HashTextEncoder(
            tcfg.joint_attention_dim, self.cfg.max_text_len, tcfg.pooled_projection_dim
        )
        self.pipe = None
        self.scheduler = self.flow_scheduler(SD3_SCHEDULER)
        self.preview = LatentRGBDecoder(self.vae.config.latent_channels, self.vae_scale)

    def build_pretrained(self, path: Path) -> None:
        from diffusers import StableDiffusion3Pipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers SD3 checkpoint (no model_index.json)"
            )
        # a component the checkpoint saved as null (e.g. no T5: SD3 runs without it) loads as None
        index = json.loads((path / "model_index.json").read_text())
        absent = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None}
        self.pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=self.dtype, **absent)
        self.place_pipe()  # model.offload_text_encoders: the encoders stay on the CPU
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = None

    @property
    def vae_scale(self) -> int:
        return self.vae_factors(self.vae.config)[0]

    def check_shapes(self) -> None:
        # the VAE's compression, then 2x2 patches: pixels must divide by vae_scale * 2 (16 for the real
        # VAE, 8 for the tiny one); the pipeline rejects other sizes too
        h, w = self.cfg.height, self.cfg.width
        unit = 16 if self.cfg.pretrained is not None else 8
        if h % unit or w % unit:
            raise UserError(f"model.height/width: SD3 needs multiples of {unit} pixels, got {h}x{w}")
        if self.cfg.frames is not None:
            raise UserError("model.frames: SD3 is an image model; leave frames unset")

    # ------------------------------------------------------------------ cost
    @classmethod
    def published_model(cls, model) -> PublishedModel:
        # stabilityai/stable-diffusion-3.5-large(-turbo) vs -medium: the checkpoint directory's name
        large = model.pretrained is not None and "large" in Path(model.pretrained).name.lower()
        return SD35_LARGE if large else SD35_MEDIUM

    @classmethod
    def vae_factors(cls, vae_config) -> tuple[int, int]:
        return 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1), 1

    @classmethod
    def latent_shape_for(cls, model, transformer_config, vae_config) -> tuple[int, ...]:
        s = cls.vae_factors(vae_config)[0]
        return (transformer_config["in_channels"], model.height // s, model.width // s)

    @classmethod
    def sequence_tokens(cls, transformer_config, latent_shape) -> int:
        p = transformer_config.get("patch_size", 2)
        return (latent_shape[1] // p) * (latent_shape[2] // p)

    @classmethod
    def tokens(cls, model, transformer_config, vae_config) -> Tokens:
        t = super().tokens(model, transformer_config, vae_config)
        if model.preset == "tiny" and model.pretrained is None:
            return t  # the stand-in encoder: max_text_len tokens
        return Tokens(t.x, CLIP_TOKENS + model.max_text_len, t.latent_elements, t.pixels)

    @classmethod
    def guidance_passes(cls, guidance: float) -> int:
        return 2 if guidance > 1.0 else 1

    @classmethod
    def forward_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        d, n, p = hidden_size(c), nx + nt, c.get("patch_size", 2)
        cin, cout = c["in_channels"], c.get("out_channels") or c["in_channels"]
        dual = len(c.get("dual_attention_layers") or ())
        # patch embedding, caption projection, timestep + pooled-text MLPs
        embed = 2 * cin * p * p * d * nx + 2 * c["joint_attention_dim"] * d * nt
        embed += 2 * (256 * d + d * d) + 2 * (c["pooled_projection_dim"] * d + d * d)
        # a joint block: qkv + out + 4x MLP per token (12 d^2), joint attention, two 6d modulations
        joint = 2 * 12 * d * d * n + 4 * n * n * d + 2 * 2 * 6 * d * d
        # the last block's text stream only feeds keys / values (qkv, no out / MLP; a 2d modulation)
        last = 2 * (12 * d * d * nx + 3 * d * d * nt) + 4 * n * n * d + 2 * (6 + 2) * d * d
        # MMDiT-X: a second, image-only attention (qkv + out) and a 9d instead of 6d modulation
        extra = dual * (2 * 4 * d * d * nx + 4 * nx * nx * d + 2 * 3 * d * d)
        blocks = (c["num_layers"] - 1) * joint + last + extra
        return embed + blocks + 2 * 2 * d * d + 2 * d * p * p * cout * nx

    @classmethod
    def attention_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx = transformer_config, tokens.x
        d, n = hidden_size(c), tokens.x + tokens.text
        return c["num_layers"] * 4 * n * n * d + len(c.get("dual_attention_layers") or ()) * 4 * nx * nx * d

    # ------------------------------------------------------------------ hooks
    def latent_shape(self) -> tuple[int, ...]:
        return self.latent_shape_for(self.cfg, self.transformer.config, self.vae.config)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return self._set_timesteps(num_steps)

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (B, 77 + L, 4096), pooled (B, 2048)) from the three encoders; the stand-in's with
        the tiny preset."""
        if self.pipe is None:
            t = self.text(prompts)
            return t["embeds"].to(self.device), t["pooled"].to(self.device)
        with torch.no_grad():
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                prompt_3=None,
                device=self.device,
                do_classifier_free_guidance=False,
                max_sequence_length=self.cfg.max_text_len,
            )
        return embeds, pooled

    def encode_prompts(self, prompts: list[str]) -> Cond:
        embeds, pooled = self._encode(prompts)
        batched = {"prompt_embeds": embeds, "pooled": pooled}
        if self.uses_cfg():  # the negative prompt (the pipeline's default: "") travels with every sample
            neg, neg_pooled = self._encode([self.sampling.negative_prompt or ""])
            batched["neg_prompt_embeds"] = neg.expand(len(prompts), -1, -1).clone()
            batched["neg_pooled"] = neg_pooled.expand(len(prompts), -1).clone()
        return Cond(batched)

    # ------------------------------------------------------------------ CFG (adapters/guidance.py)
    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma.to(torch.float32) * 1000  # the scheduler's timesteps, as the pipeline feeds them

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        b = cond.batched
        if negative:
            return {"embeds": b["neg_prompt_embeds"], "pooled": b["neg_pooled"]}
        return {"embeds": b["prompt_embeds"], "pooled": b["pooled"]}

    def forward_pass(
        self, latents: torch.Tensor, t: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        with self.autocast():
            out = self.transformer(
                hidden_states=latents.to(self.dtype),
                timestep=t,  # fp32, as StableDiffusion3Pipeline (bf16 would round 937.5 to 936)
                encoder_hidden_states=inputs["embeds"].to(self.dtype),
                pooled_projections=inputs["pooled"].to(self.dtype),
                return_dict=False,
            )[0]
        return out.float()

    def guide(self, v_cond: torch.Tensor, v_unc: torch.Tensor) -> torch.Tensor:
        return v_unc + self.sampling.guidance * (v_cond - v_unc)

    def vae_decode(self, x: torch.Tensor) -> torch.Tensor:
        vc = self.vae.config
        x = x / vc.scaling_factor + vc.shift_factor  # the pipeline's exact op order
        image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]
        return unit_range(image)
