"""FLUX.1 Kontext (``FluxTransformer2DModel``): FLUX.1 conditioned on an input image to edit.

Mirrors ``diffusers.FluxKontextPipeline``: the input image is resized (``_auto_resize``: to the
preferred Kontext resolution nearest its aspect ratio, 1024 x 1024 for a square) and normalised,
encoded by the VAE to its latent mode, shifted and scaled, packed 2x2 like the noisy latents and
concatenated after them along the sequence; its position ids are its own grid with the first
coordinate 1 instead of 0. The transformer's output for the image tokens is dropped. Everything else
(guidance embedding, dynamic shift from the noisy tokens alone, decode) is FLUX.1's. The tiny preset
conditions at the output's own size (the pipeline's ``_auto_resize=False``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import Tokens
from digenrl.adapters.edit import absent_components, pack, preprocess, read_image
from digenrl.adapters.flux import FLUX1_DEV, TINY_TRANSFORMER, TINY_VAE, FluxAdapter
from digenrl.errors import UserError

# black-forest-labs/FLUX.1-Kontext-dev: transformer/config.json is FLUX.1-dev's (12B)
FLUX1_KONTEXT_DEV = replace(FLUX1_DEV, label="FLUX.1-Kontext-dev (12B)")

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

    tiny_at_output_size = True  # the tiny preset conditions at the output's size (1024^2 is 64k tokens)

    @classmethod
    def condition_size(cls, model, vae_scale: int) -> tuple[int, int]:
        """(height, width) the input image is encoded at: the pipeline's preferred Kontext resolution
        nearest the image's aspect ratio, in multiples of 2 x the VAE's factor; the tiny preset's output
        size."""
        if model.pretrained is None and model.preset == "tiny" and cls.tiny_at_output_size:
            return model.height, model.width
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        ratio = model.width / model.height  # the image's: it is the output's size (data/prompts.py)
        _, w, h = min((abs(ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        m = 2 * vae_scale
        return h // m * m, w // m * m

    def condition_grid(self) -> tuple[int, int]:
        h, w = self.condition_size(self.cfg, self.vae_scale)
        return h // self.vae_scale // 2, w // self.vae_scale // 2

    # ------------------------------------------------------------------ cost
    @classmethod
    def tokens(cls, model, transformer_config, vae_config) -> Tokens:
        t = super().tokens(model, transformer_config, vae_config)
        s = cls.vae_factors(vae_config)[0]
        h, w = cls.condition_size(model, s)
        return Tokens(t.x + (h // s // 2) * (w // s // 2), t.text, t.latent_elements, t.pixels)

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
        h, w = self.condition_size(self.cfg, self.vae_scale)
        pixels = preprocess([read_image(p) for p in paths], self.vae_scale, h, w)
        vc = self.vae.config
        latents = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()
        return pack((latents - vc.shift_factor) * vc.scaling_factor).float()

    def image_tokens(self, latents: torch.Tensor, cond: Cond) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = self.condition_grid()
        source = torch.ones(rows, cols, 3)  # the input image's ids: its own grid, first coordinate 1
        source[..., 1] = torch.arange(rows)[:, None]
        source[..., 2] = torch.arange(cols)[None, :]
        ids = torch.cat([self.img_ids(), source.reshape(rows * cols, 3).to(self.device)])
        return torch.cat([latents, cond.batched["image_latents"]], dim=1), ids
