"""HunyuanVideo (``HunyuanVideoTransformer3DModel``): (B, C, F, H, W) latents, embedded guidance, fixed shift.

Details: docs/modules.md, `digenrl.adapters.hunyuan_video`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from digenrl.adapters.base import Adapter, seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import PublishedModel, Tokens, hidden_size
from digenrl.adapters.pixels import unit_range
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_text import HashTextEncoder
from digenrl.errors import UserError

# values as in diffusers' own HunyuanVideo tests
TINY_TRANSFORMER = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=10,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    patch_size=1,
    patch_size_t=1,
    guidance_embeds=True,
    text_embed_dim=16,
    pooled_projection_dim=8,
    rope_axes_dim=(2, 4, 4),
)
# diffusers' dummy VAE for HunyuanVideoPipeline tests: 4 blocks -> the real 8x spatial / 4x temporal
# compression
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    down_block_types=("HunyuanVideoDownBlock3D",) * 4,
    up_block_types=("HunyuanVideoUpBlock3D",) * 4,
    block_out_channels=(8, 8, 8, 8),
    layers_per_block=1,
    act_fn="silu",
    norm_num_groups=4,
    scaling_factor=0.476986,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
    mid_block_add_attention=True,
)
HUNYUAN_SHIFT = 7.0  # HunyuanVideo's scheduler config (FlowMatchEulerDiscreteScheduler(shift=7.0))
PIXEL_UNIT = 16  # the pipeline's own check_inputs: height/width % 16 (VAE 8x x real patch_size 2)
TEMPORAL = 4  # causal 3-D VAE: frames = 4k + 1 -> k + 1 latent frames

# hunyuanvideo-community/HunyuanVideo: transformer/config.json and vae/config.json's compression
HUNYUAN_VIDEO = PublishedModel(
    label="HunyuanVideo (13B)",
    transformer=dict(
        in_channels=16,
        out_channels=16,
        num_attention_heads=24,
        attention_head_dim=128,
        num_layers=20,
        num_single_layers=40,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=2,
        patch_size_t=1,
        qk_norm="rms_norm",
        guidance_embeds=True,
        text_embed_dim=4096,
        pooled_projection_dim=768,
        rope_theta=256.0,
        rope_axes_dim=[16, 56, 56],
    ),
    vae=dict(spatial_compression_ratio=8, temporal_compression_ratio=4),
    vae_params=246e6,
    vae_decode_flops_per_px=20e6,
    text_encoder_params=7.5e9 + 0.123e9,  # LLaVA-LLaMA-3-8B language model + CLIP-L
)


class HunyuanVideoAdapter(Adapter):
    name = "hunyuan_video"
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_class = "HunyuanVideoPipeline"
    transformer_class = "HunyuanVideoTransformer3DModel"
    published = HUNYUAN_VIDEO
    presets = {"tiny": (TINY_TRANSFORMER, TINY_VAE)}

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel

        if preset != "tiny":
            raise UserError(f"model.preset: unknown preset '{preset}' for hunyuan_video (available: tiny)")
        with seeded(1234):
            self.transformer = HunyuanVideoTransformer3DModel(**TINY_TRANSFORMER)
            self.vae = AutoencoderKLHunyuanVideo(**TINY_VAE).eval()
        tcfg = self.transformer.config
        self.text = HashTextEncoder(tcfg.text_embed_dim, self.cfg.max_text_len, tcfg.pooled_projection_dim)
        self.pipe = None
        self.scheduler = self.flow_scheduler({"shift": HUNYUAN_SHIFT})
        self.preview = LatentRGBDecoder(
            self.vae.config.latent_channels,
            self.vae.spatial_compression_ratio,
            self.vae.temporal_compression_ratio,
        )

    def build_pretrained(self, path: Path) -> None:
        from diffusers import HunyuanVideoPipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers HunyuanVideo checkpoint (no model_index.json)"
            )
        self.pipe = HunyuanVideoPipeline.from_pretrained(
            path, torch_dtype=self.dtype
        )  # LLaMA + CLIP encoders
        self.place_pipe()  # model.offload_text_encoders: the encoders stay on the CPU
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = None

    def check_shapes(self) -> None:
        # runs before build: the tiny preset and the real checkpoint share the 8x/4x VAE, so constants suffice
        h, w, f = self.cfg.height, self.cfg.width, self.cfg.frames
        for field, size in (("height", h), ("width", w)):
            if size % PIXEL_UNIT:
                raise UserError(
                    f"model.{field}: HunyuanVideo needs a multiple of {PIXEL_UNIT} pixels, got {size}"
                )
        if f is None:
            raise UserError(
                "model.frames: HunyuanVideo is a video model; set frames (4k+1, e.g. 9, 33, 53, 129)"
            )
        if (f - 1) % TEMPORAL:
            raise UserError(
                f"model.frames: HunyuanVideo's causal VAE needs 4k+1 frames (e.g. 9, 33, 53), got {f}"
            )

    # ------------------------------------------------------------------ cost
    @classmethod
    def vae_factors(cls, vae_config) -> tuple[int, int]:
        return vae_config.get("spatial_compression_ratio", 8), vae_config.get("temporal_compression_ratio", 4)

    @classmethod
    def latent_shape_for(cls, model, transformer_config, vae_config) -> tuple[int, int, int, int]:
        """As HunyuanVideoPipeline.prepare_latents: (C, (F-1)//t + 1, H//s, W//s)."""
        s, t = cls.vae_factors(vae_config)
        frames = ((model.frames or 1) - 1) // t + 1
        return (transformer_config["in_channels"], frames, model.height // s, model.width // s)

    @classmethod
    def sequence_tokens(cls, transformer_config, latent_shape) -> int:
        pt, p = transformer_config.get("patch_size_t", 1), transformer_config.get("patch_size", 2)
        _, f, h, w = latent_shape
        return (f // pt) * (h // p) * (w // p)

    @classmethod
    def forward_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        d, n = hidden_size(c), nx + nt
        pv = c.get("patch_size_t", 1) * c.get("patch_size", 2) ** 2
        cin, cout = c["in_channels"], c.get("out_channels") or c["in_channels"]
        r = c.get("mlp_ratio", 4.0)
        per_token = (4 + 2 * r) * d * d  # qkv + out (or proj_out's share) + MLP, per stream
        refiner = (
            2 * c["text_embed_dim"] * d * nt
            + 2 * (256 * d + d * d)
            + c.get("num_refiner_layers", 2) * (2 * per_token * nt + 4 * nt * nt * d + 2 * 2 * d * d)
        )
        n_emb = 2 if c.get("guidance_embeds") else 1
        embed = 2 * cin * pv * d * nx + refiner + 2 * n_emb * (256 * d + d * d)
        embed += 2 * (c["pooled_projection_dim"] * d + d * d)
        double = c["num_layers"] * (2 * per_token * n + 4 * n * n * d + 2 * 2 * 6 * d * d)
        single = c["num_single_layers"] * (2 * per_token * n + 4 * n * n * d + 2 * 3 * d * d)
        return embed + double + single + 2 * 2 * d * d + 2 * d * cout * pv * nx

    # ------------------------------------------------------------------ hooks
    def encode_prompts(self, prompts: list[str]) -> Cond:
        if self.pipe is not None:
            with torch.no_grad():
                embeds, pooled, mask = self.pipe.encode_prompt(
                    prompt=prompts, device=self.device, max_sequence_length=self.cfg.max_text_len
                )
        else:
            t = self.text(prompts)
            embeds, pooled, mask = t["embeds"], t["pooled"], t["mask"]
        # the transformer reads only mask.sum(1): a right-padded (left-aligned) mask is the only correct one
        prefix = torch.arange(mask.shape[1], device=mask.device)[None] < mask.sum(1, keepdim=True)
        if not torch.equal(
            mask.bool(), prefix
        ):  # only a checkpoint's tokenizer (padding_side="left") can do this
            raise UserError(
                f"model.pretrained: {self.cfg.pretrained}: the tokenizer must pad on the right for Hunyuan"
            )
        return Cond(
            {k: v.to(self.device) for k, v in (("prompt_embeds", embeds), ("pooled", pooled), ("mask", mask))}
        )

    def latent_shape(self) -> tuple[int, ...]:
        return self.latent_shape_for(self.cfg, self.transformer.config, self.vae.config)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        shift = self.sampling.shift if self.sampling.shift is not None else self.scheduler.config.shift
        sched = self.flow_scheduler({**dict(self.scheduler.config), "shift": shift})
        sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])  # the pipeline's own call
        return sched.sigmas.to(torch.float32).clone()

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        b = latents.shape[0]
        # pipeline: torch.tensor([g] * B, dtype=transformer_dtype) * 1000.0 (rounded in the model dtype first)
        guidance = torch.full((b,), self.sampling.guidance, dtype=self.dtype, device=self.device) * 1000.0
        # pipeline: t.expand(B).to(latents.dtype), t = 1000 sigma (fp32); its latents turn to the model
        # dtype at its first scheduler step (the step returns the model output's dtype): from the second
        # step on the timestep is rounded to it (the first, 1000, is exact in bf16)
        t = (sigma.to(torch.float32) * 1000).to(self.dtype)
        with self.autocast():
            out = self.transformer(
                hidden_states=latents.to(self.dtype),
                timestep=t,
                encoder_hidden_states=cond.batched["prompt_embeds"].to(self.dtype),
                encoder_attention_mask=cond.batched["mask"].to(self.dtype),
                pooled_projections=cond.batched["pooled"].to(self.dtype),
                guidance=guidance,
                return_dict=False,
            )[0]
        return out.float()

    @torch.no_grad()
    def vae_decode(self, x: torch.Tensor) -> torch.Tensor:
        x = x / self.vae.config.scaling_factor  # no shift factor for this VAE
        video = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]
        return unit_range(video)  # VideoProcessor.postprocess_video: [-1,1] -> [0,1]
