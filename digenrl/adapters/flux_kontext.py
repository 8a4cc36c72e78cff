"""FLUX.1 Kontext (``FluxTransformer2DModel``): FLUX.1 conditioned on an input image to edit.

Mirrors ``diffusers.FluxKontextPipeline``: the input image is resized and normalised to the output
size, encoded by the VAE to its latent mode, shifted and scaled, packed 2x2 like the noisy latents and
concatenated after them along the sequence; its position ids are the latents' grid with the first
coordinate 1 instead of 0. The transformer's output for the image tokens is dropped. Everything
else (guidance embedding, dynamic shift from the noisy tokens alone, decode) is FLUX.1's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from digenrl.adapters.base import PublishedModel
from digenrl.adapters.cond import Cond
from digenrl.adapters.edit import absent_components, pack, preprocess, read_image
from digenrl.adapters.flux import FLUX1_DEV, TINY_TRANSFORMER, TINY_VAE, FluxAdapter
from digenrl.errors import UserError

# black-forest-labs/FLUX.1-Kontext-dev: transformer/config.json is FLUX.1-dev's (12B)
FLUX1_KONTEXT_DEV = PublishedModel(
    label="FLUX.1-Kontext-dev (12B)",
    transformer=dict(FLUX1_DEV.transformer),
    vae=FLUX1_DEV.vae,
    vae_params=FLUX1_DEV.vae_params,
    vae_decode_flops_per_px=FLUX1_DEV.vae_decode_flops_per_px,
    text_encoder_params=FLUX1_DEV.text_encoder_params,
)

#: FLUX's tiny VAE with the real one's shift and scale (the pipeline subtracts the shift when it encodes)
TINY_KONTEXT_VAE = dict(TINY_VAE, shift_factor=0.1159, scaling_factor=0.3611)


class FluxKontextAdapter(FluxAdapter):
    name = "flux_kontext"
    edits = True
    # flow_grpo scripts/train_flux_kontext.py: FLUX's attention and MLPs, and the single blocks' MLP
    default_lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "proj_mlp",
    )
    pipeline_class = "FluxKontextPipeline"
    published = FLUX1_KONTEXT_DEV
    presets = {"tiny": (TINY_TRANSFORMER, TINY_KONTEXT_VAE)}

    def build_pretrained(self, path: Path) -> None:
        from diffusers import FluxKontextPipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers FLUX.1 Kontext checkpoint (no model_index.json)"
            )
        self.pipe = FluxKontextPipeline.from_pretrained(
            path, torch_dtype=self.dtype, **absent_components(path)
        )
        self.place_pipe()
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = None

    # ------------------------------------------------------------------ cost
    @classmethod
    def sequence_tokens(cls, transformer_config, latent_shape) -> int:
        return 2 * latent_shape[0]  # the noisy latents' tokens, then the input image's (same size)

    # ------------------------------------------------------------------ hooks
    def encode_prompts(self, prompts: list[str], images: list[str | None] | None = None) -> Cond:
        if images is None or None in images:
            raise ValueError("flux_kontext encodes an (instruction, input image) pair: an image per prompt")
        cond = super().encode_prompts(prompts)
        cond.batched["image_latents"] = self.encode_images(images)
        return cond

    @torch.no_grad()
    def encode_images(self, paths: list[str]) -> torch.Tensor:
        """Packed image latents (B, rows*cols, 4C), fp32, as ``FluxKontextPipeline.prepare_latents``."""
        pixels = preprocess([read_image(p) for p in paths], self.vae_scale, self.cfg.height, self.cfg.width)
        vc = self.vae.config
        latents = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()
        return pack((latents - vc.shift_factor) * vc.scaling_factor).float()

    def image_tokens(self, latents: torch.Tensor, cond: Cond) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.img_ids()
        source = ids.clone()
        source[:, 0] = 1  # the input image's ids: the same grid, first coordinate 1
        return torch.cat([latents, cond.batched["image_latents"]], dim=1), torch.cat([ids, source])
