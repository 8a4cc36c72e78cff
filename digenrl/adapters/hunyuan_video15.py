"""HunyuanVideo-1.5 (``HunyuanVideo15Transformer3DModel``): (B, C, F, H, W) latents beside a zero
condition and mask, Qwen2.5-VL + ByT5 text, the guider's CFG.

Mirrors ``diffusers.HunyuanVideo15Pipeline`` (text to video): the transformer reads the latents
concatenated with zero condition latents and a zero mask (2C + 1 channels) and zero image embeddings
(729 tokens, masked); the text is Qwen2.5-VL's third-to-last hidden state with its mask, and ByT5's
encoding of the prompt's quoted text (zeros and an all-zero mask when there is none); the sigmas are
``linspace(1, 0, N + 1)[:-1]`` through the scheduler's fixed shift; the timestep is ``1000 sigma`` in
the model dtype; CFG (``ClassifierFreeGuidance``) is ``neg + g (pos - neg)`` when ``g != 1``.
Details: docs/modules.md, `digenrl.adapters.hunyuan_video15`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from digenrl.adapters.base import Adapter, seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import PublishedModel, Tokens, hidden_size
from digenrl.adapters.guidance import TwoPassCFG
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_lm import TinyLM
from digenrl.errors import UserError

IMAGE_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: zero image embeddings (t2v)
TINY_TRANSFORMER = dict(
    in_channels=9,  # 4 latent channels, 4 of the (zero) condition, 1 mask
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    text_embed_dim=16,
    text_embed_2_dim=16,
    image_embed_dim=16,
    rope_axes_dim=(4, 6, 6),
    target_size=32,
    task_type="t2v",
)
TINY_VAE = dict(
    latent_channels=4,
    block_out_channels=(16, 16, 16),
    layers_per_block=1,
    spatial_compression_ratio=4,
    temporal_compression_ratio=2,
)
TINY_BYT5 = dict(vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v: scheduler_config.json's fixed shift
HV15_SCHEDULER = dict(shift=5.0, use_dynamic_shifting=False)

# HunyuanVideo-1.5 480p text-to-video: transformer/config.json (8.3B), its 16x / 4x VAE
HUNYUAN_VIDEO15 = PublishedModel(
    label="HunyuanVideo-1.5 (8.3B)",
    transformer=dict(
        in_channels=65,
        out_channels=32,
        num_attention_heads=16,
        attention_head_dim=128,
        num_layers=54,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=3584,
        text_embed_2_dim=1472,
        image_embed_dim=1152,
        rope_theta=256.0,
        rope_axes_dim=[16, 56, 56],
        target_size=640,
        task_type="t2v",
    ),
    vae=dict(spatial_compression_ratio=16, temporal_compression_ratio=4, latent_channels=32),
    vae_params=0.25e9,
    vae_decode_flops_per_px=10e6,
    text_encoder_params=8.29e9 + 0.22e9,  # Qwen2.5-VL-7B + ByT5 (Glyph-SDXL-v2)
)


class HunyuanVideo15Adapter(TwoPassCFG, Adapter):
    name = "hunyuan_video15"
    # UniRL examples/diffusion/hunyuan_video15/hunyuan_video15_t2v_dancegrpo_trainside.yaml (@ 36547bd):
    # both streams' attention and feed-forward projections
    default_lora_targets = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    pipeline_class = "HunyuanVideo15Pipeline"
    # HunyuanVideo15Pipeline has no LoRA loader (diffusers 0.42): the file is written by HunyuanVideo's
    # (transformer.-prefixed peft keys); the stock pipeline's transformer reads it with
    # ``load_lora_adapter(dir, prefix="transformer", weight_name=...)``
    lora_pipeline_class = "HunyuanVideoPipeline"
    transformer_class = "HunyuanVideo15Transformer3DModel"
    published = HUNYUAN_VIDEO15
    presets = {"tiny": (TINY_TRANSFORMER, TINY_VAE)}
    GENERATION_PIPE_PARTS = Adapter.GENERATION_PIPE_PARTS + ("guider",)

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel
        from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

        if preset != "tiny":
            raise UserError(f"model.preset: unknown preset '{preset}' for hunyuan_video15 (available: tiny)")
        with seeded(1234):
            self.transformer = HunyuanVideo15Transformer3DModel(**self.presets["tiny"][0])
            self.vae = AutoencoderKLHunyuanVideo15(**TINY_VAE).eval()
            self.byt5 = (ByT5Tokenizer(), T5EncoderModel(T5Config(**TINY_BYT5)).eval())
        self.text = TinyLM.qwen2_5_vl(TINY_TRANSFORMER["text_embed_dim"], 3, self.cfg.max_text_len)
        self.pipe = None
        self.scheduler = self.flow_scheduler(HV15_SCHEDULER)
        self.preview = LatentRGBDecoder(self.vae.config.latent_channels, *self.vae_factors(self.vae.config))

    def build_pretrained(self, path: Path) -> None:
        from diffusers import HunyuanVideo15Pipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers HunyuanVideo-1.5 checkpoint "
                "(no model_index.json)"
            )
        self.pipe = HunyuanVideo15Pipeline.from_pretrained(path, torch_dtype=self.dtype)
        # the caption's and the quoted text's tokens kept: model.max_text_len (the pipeline: 1000, 256)
        self.pipe.tokenizer_max_length = self.pipe.tokenizer_2_max_length = self.cfg.max_text_len
        self.place_pipe()  # model.offload_text_encoders: the encoders stay on the CPU
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = self.byt5 = None

    def release_generation_modules(self) -> None:
        super().release_generation_modules()
        self.byt5 = None

    def check_shapes(self) -> None:
        s, t = (16, 4) if self.cfg.pretrained is not None else self.vae_factors(TINY_VAE)
        h, w, f = self.cfg.height, self.cfg.width, self.cfg.frames
        if h % s or w % s:
            raise UserError(
                f"model.height/width: HunyuanVideo-1.5 needs multiples of {s} pixels, got {h}x{w}"
            )
        if f is None or (f - 1) % t:
            raise UserError(f"model.frames: HunyuanVideo-1.5 needs {t} k + 1 frames, got {f}")

    # ------------------------------------------------------------------ cost
    @classmethod
    def vae_factors(cls, vae_config) -> tuple[int, int]:
        return vae_config.get("spatial_compression_ratio", 16), vae_config.get(
            "temporal_compression_ratio", 4
        )

    @classmethod
    def latent_shape_for(cls, model, transformer_config, vae_config) -> tuple[int, ...]:
        s, t = cls.vae_factors(vae_config)
        return (
            transformer_config["out_channels"],
            (model.frames - 1) // t + 1,
            model.height // s,
            model.width // s,
        )

    @classmethod
    def sequence_tokens(cls, transformer_config, latent_shape) -> int:
        p, pt = transformer_config.get("patch_size", 1), transformer_config.get("patch_size_t", 1)
        return (latent_shape[1] // pt) * (latent_shape[2] // p) * (latent_shape[3] // p)

    @classmethod
    def tokens(cls, model, transformer_config, vae_config) -> Tokens:
        t = super().tokens(model, transformer_config, vae_config)  # text: the caption, ByT5's and the image's
        return Tokens(t.x, 2 * model.max_text_len + IMAGE_TOKENS, t.latent_elements, t.pixels)

    @classmethod
    def blocks(cls, transformer_config) -> int:
        return transformer_config["num_layers"]

    @classmethod
    def guidance_passes(cls, guidance: float) -> int:
        return 1 if math.isclose(guidance, 1.0) else 2

    @classmethod
    def forward_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        d, n, f = hidden_size(c), nx + nt, int(hidden_size(c) * c.get("mlp_ratio", 4.0))
        length, ci = (nt - IMAGE_TOKENS) // 2, c["image_embed_dim"]  # the caption's = ByT5's tokens
        embed = (
            2 * c["in_channels"] * d * nx + 2 * c["text_embed_dim"] * d * length + 2 * 2 * (256 * d + d * d)
        )
        embed += 2 * length * (c["text_embed_2_dim"] * 2048 + 2048 * 2048 + 2048 * d)  # ByT5's projection
        embed += 2 * IMAGE_TOKENS * (ci * ci + ci * d)  # the (zero) image embeddings' projection
        blocks = c["num_layers"] * (2 * (4 * d * d + 2 * d * f) * n + 4 * n * n * d + 2 * 2 * 6 * d * d)
        return embed + blocks + 2 * 2 * d * d + 2 * d * c["out_channels"] * nx

    # ------------------------------------------------------------------ hooks
    def latent_shape(self) -> tuple[int, ...]:
        return self.latent_shape_for(self.cfg, self.transformer.config, self.vae.config)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        sched = self.scheduler
        if self.sampling.shift is not None:  # a user-fixed shift replaces the checkpoint's
            sched = self.flow_scheduler({"shift": self.sampling.shift, "use_dynamic_shifting": False})
        sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])  # the pipeline's
        return sched.sigmas.to(torch.float32).clone()

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The caption (B, L, D) and ByT5's glyph text (B, L2, D2), each with its mask."""
        from diffusers import HunyuanVideo15Pipeline

        if self.pipe is not None:
            with torch.no_grad():
                e, m, e2, m2 = self.pipe.encode_prompt(
                    prompt=list(prompts), device=self.device, dtype=self.dtype, batch_size=len(prompts)
                )
            return {
                "prompt_embeds": e,
                "prompt_embeds_mask": m,
                "prompt_embeds_2": e2,
                "prompt_embeds_mask_2": m2,
            }
        states, mask = self.text.hidden_states(prompts)
        with torch.no_grad():
            e2, m2 = HunyuanVideo15Pipeline._get_byt5_prompt_embeds(
                *self.byt5, list(prompts), torch.device("cpu"), self.cfg.max_text_len
            )
        out = {
            "prompt_embeds": states[-3],
            "prompt_embeds_mask": mask.float(),
            "prompt_embeds_2": e2,
            "prompt_embeds_mask_2": m2.float(),
        }
        return {k: v.to(self.device) for k, v in out.items()}

    def encode_prompts(self, prompts: list[str]) -> Cond:
        batched = self._encode(prompts)
        if self.uses_cfg():  # the guider's second condition: the negative prompt
            neg = self._encode([self.sampling.negative_prompt or ""] * len(prompts))
            batched.update({f"neg_{k}": v for k, v in neg.items()})
        return Cond(batched)

    # ------------------------------------------------------------------ CFG (adapters/guidance.py)
    def uses_cfg(self) -> bool:
        return not math.isclose(self.sampling.guidance, 1.0)  # ClassifierFreeGuidance._is_cfg_enabled

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        # the pipeline: the scheduler's timestep cast to its latents' dtype (the transformer's)
        return (sigma.to(torch.float32) * 1000).to(self.dtype)

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        pre = "neg_" if negative else ""
        return {
            k: cond.batched[pre + k]
            for k in ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
        }

    def forward_pass(
        self, latents: torch.Tensor, t: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        x = latents.to(self.dtype)
        first, mask, image = self.condition(x, inputs)
        x = torch.cat([x, first, mask], dim=1)
        with self.autocast():
            out = self.transformer(
                hidden_states=x,
                image_embeds=image,
                timestep=t,
                encoder_hidden_states=inputs["prompt_embeds"].to(self.dtype),
                encoder_attention_mask=inputs["prompt_embeds_mask"].to(self.dtype),
                encoder_hidden_states_2=inputs["prompt_embeds_2"].to(self.dtype),
                encoder_attention_mask_2=inputs["prompt_embeds_mask_2"].to(self.dtype),
                return_dict=False,
            )[0]
        return out.float()

    def condition(self, x: torch.Tensor, inputs: dict[str, torch.Tensor]):
        """(condition latents, mask, image embeddings) beside ``x``: t2v has none (zeros, which the
        transformer masks out)."""
        zeros = torch.zeros_like(x)
        image = torch.zeros(
            len(x), IMAGE_TOKENS, self.transformer.config.image_embed_dim, device=x.device, dtype=x.dtype
        )
        return zeros, zeros[:, :1], image

    def guide(self, v_cond: torch.Tensor, v_unc: torch.Tensor) -> torch.Tensor:
        return v_unc + self.sampling.guidance * (v_cond - v_unc)

    def vae_decode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.vae.dtype) / self.vae.config.scaling_factor
        video = self.vae.decode(x, return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1)
