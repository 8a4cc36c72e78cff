"""FLUX.1 (``FluxTransformer2DModel``): packed 2x2 latent tokens, guidance embedding, dynamic shift.

Mirrors ``diffusers.FluxPipeline``: latents (B, C, H, W) are packed into (B, H/2*W/2, 4C) tokens with
2-D ``img_ids`` rows [0, row, col]; ``txt_ids`` are zeros; the timestep is sigma in [0, 1]; the sigma
schedule is ``linspace(1, 1/N, N)`` shifted by ``mu = calculate_shift(image_seq_len)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from digenrl.adapters.base import seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import PublishedModel, Tokens, hidden_size
from digenrl.adapters.packed import PackedLatentAdapter
from digenrl.adapters.pixels import unit_range
from digenrl.adapters.preview import LatentRGBDecoder
from digenrl.adapters.tiny_text import HashTextEncoder
from digenrl.errors import UserError

TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 4, 8),
    guidance_embeds=True,
)
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(8, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
)
# FLUX.1's own scheduler config (dynamic shifting from the image token count)
FLUX_SCHEDULER = dict(
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

# black-forest-labs/FLUX.1-dev: transformer/config.json, and the VAE's four blocks (8x)
FLUX1_DEV = PublishedModel(
    label="FLUX.1-dev (12B)",
    transformer=dict(
        attention_head_dim=128,
        guidance_embeds=True,
        in_channels=64,
        joint_attention_dim=4096,
        num_attention_heads=24,
        num_layers=19,
        num_single_layers=38,
        patch_size=1,
        pooled_projection_dim=768,
        axes_dims_rope=[16, 56, 56],
    ),
    vae=dict(block_out_channels=[128, 256, 512, 512]),
    vae_params=83.8e6,
    vae_decode_flops_per_px=6.6e6,
    text_encoder_params=4.76e9 + 0.123e9,  # T5-XXL encoder + CLIP-L
)


class FluxAdapter(PackedLatentAdapter):
    name = "flux"
    default_lora_targets = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    pipeline_class = "FluxPipeline"
    transformer_class = "FluxTransformer2DModel"
    published = FLUX1_DEV
    presets = {"tiny": (TINY_TRANSFORMER, TINY_VAE)}

    # ------------------------------------------------------------------ build
    def build_preset(self, preset: str) -> None:
        from diffusers import AutoencoderKL, FluxTransformer2DModel

        if preset != "tiny":
            raise UserError(f"model.preset: unknown preset '{preset}' for {self.name} (available: tiny)")
        transformer, vae = self.presets["tiny"]
        with seeded(1234):
            self.transformer = FluxTransformer2DModel(**transformer)
            self.vae = AutoencoderKL(**vae).eval()
        tcfg = self.transformer.config
        self.text = HashTextEncoder(
            tcfg.joint_attention_dim, self.cfg.max_text_len, tcfg.pooled_projection_dim
        )
        self.pipe = None
        self.scheduler = self.flow_scheduler(FLUX_SCHEDULER)
        self.preview = LatentRGBDecoder(self.vae.config.latent_channels, self.vae_scale)

    def build_pretrained(self, path: Path) -> None:
        from diffusers import FluxPipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers FLUX checkpoint (no model_index.json)"
            )
        self.pipe = FluxPipeline.from_pretrained(path, torch_dtype=self.dtype)
        self.place_pipe()  # model.offload_text_encoders: the encoders stay on the CPU
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = None

    def check_shapes(self) -> None:
        # FLUX packs 2x2 latent patches: pixels must divide by vae_scale * 2 (16 for the real VAE)
        h, w = self.cfg.height, self.cfg.width
        unit = 16 if self.cfg.pretrained is not None else 4
        if h % unit or w % unit:
            raise UserError(f"model.height/width: FLUX needs multiples of {unit} pixels, got {h}x{w}")
        if self.cfg.frames not in (None, 1):
            raise UserError("model.frames: FLUX is an image model; leave frames unset")

    # ------------------------------------------------------------------ cost
    @classmethod
    def vae_factors(cls, vae_config) -> tuple[int, int]:
        return 2 ** (len(vae_config.get("block_out_channels", [0] * 4)) - 1), 1

    @classmethod
    def forward_flops(cls, transformer_config, tokens: Tokens) -> float:
        c, nx, nt = transformer_config, tokens.x, tokens.text
        d, n = hidden_size(c), nx + nt
        cin, cout = c["in_channels"], c.get("out_channels") or c["in_channels"]
        n_emb = 3 if c.get("guidance_embeds") else 2  # timestep (+ guidance) + pooled text MLPs
        embed = 2 * cin * d * nx + 2 * c["joint_attention_dim"] * d * nt
        embed += 2 * (n_emb - 1) * (256 * d + d * d) + 2 * (c["pooled_projection_dim"] * d + d * d)
        double = c["num_layers"] * (2 * 12 * d * d * n + 4 * n * n * d + 2 * 2 * 6 * d * d)
        single = c["num_single_layers"] * (2 * 12 * d * d * n + 4 * n * n * d + 2 * 3 * d * d)
        return embed + double + single + 2 * 2 * d * d + 2 * d * cout * nx

    # ------------------------------------------------------------------ hooks
    def encode_prompts(self, prompts: list[str]) -> Cond:
        if self.pipe is not None:
            with torch.no_grad():
                embeds, pooled, txt_ids = self.pipe.encode_prompt(
                    prompt=prompts,
                    prompt_2=prompts,
                    device=self.device,
                    max_sequence_length=self.cfg.max_text_len,
                )
            return Cond({"prompt_embeds": embeds, "pooled": pooled}, {"txt_ids": txt_ids})
        t = self.text(prompts)
        return Cond(
            {"prompt_embeds": t["embeds"].to(self.device), "pooled": t["pooled"].to(self.device)},
            {"txt_ids": torch.zeros(self.cfg.max_text_len, 3, device=self.device)},
        )

    def img_ids(self) -> torch.Tensor:
        rows, cols = self._grid()
        ids = torch.zeros(rows, cols, 3)
        ids[..., 1] = torch.arange(rows)[:, None]
        ids[..., 2] = torch.arange(cols)[None, :]
        return ids.reshape(rows * cols, 3).to(self.device)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        b = latents.shape[0]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.sampling.guidance, device=self.device, dtype=torch.float32)
        # FluxPipeline: timestep = t.to(latents.dtype) / 1000, t = 1000 sigma (fp32), its latents in the
        # model dtype: rounded to bf16 before the division, as the pipeline does (issue 53, item 3)
        t = (sigma.to(torch.float32) * 1000).to(self.dtype) / 1000
        hidden, ids = self.image_tokens(latents, cond)
        with self.autocast():
            out = self.transformer(
                hidden_states=hidden.to(self.dtype),
                timestep=t,
                guidance=guidance,
                pooled_projections=cond.batched["pooled"].to(self.dtype),
                encoder_hidden_states=cond.batched["prompt_embeds"].to(self.dtype),
                txt_ids=cond.shared["txt_ids"],
                img_ids=ids,
                return_dict=False,
            )[0]
        return out[:, : latents.shape[1]].float()  # an edit family's image tokens are dropped

    def image_tokens(self, latents: torch.Tensor, cond: Cond) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's image-stream tokens and their position ids (an edit family adds its
        input image's)."""
        return latents, self.img_ids()

    def vae_decode(self, x: torch.Tensor) -> torch.Tensor:
        vc = self.vae.config
        x = x / vc.scaling_factor + (vc.shift_factor or 0.0)
        image = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]
        return unit_range(image)
