"""Qwen-Image-Edit (``QwenImageTransformer2DModel``): Qwen-Image conditioned on an input image to edit.

Mirrors ``diffusers.QwenImageEditPipeline``: the input image is resized to the pipeline's
conditioning size (``calculate_dimensions``: an area of 1024^2 at the output's aspect ratio, rounded
to multiples of 32), which the Qwen2.5-VL text encoder sees with the instruction (and with the negative
prompt) and the VAE encodes to its latent mode, normalised by the VAE's per-channel mean and std and
packed 2x2; those tokens follow the noisy latents along the sequence and RoPE sees both grids
(``img_shapes = [[(1, h, w), (1, h_in, w_in)]]``). The output's image tokens are dropped; true CFG,
the schedule (shift from the noisy tokens alone) and decode are Qwen-Image's.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import Tokens
from digenrl.adapters.edit import ImageToken, absent_components, pack, preprocess, read_image
from digenrl.adapters.qwen_image import QWEN_IMAGE, QwenImageAdapter, valid_lengths
from digenrl.errors import UserError

#: the pipeline's conditioning area (``calculate_dimensions(1024 * 1024, ratio)``)
CONDITION_AREA = 1024 * 1024

# Qwen/Qwen-Image-Edit: transformer/config.json is Qwen-Image's (20B)
QWEN_IMAGE_EDIT = replace(QWEN_IMAGE, label="Qwen-Image-Edit (20B)")


def condition_size(area: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) the pipeline resizes the input image to: ``area`` at the image's aspect ratio,
    each side rounded to a multiple of 32 (``calculate_dimensions``)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / ratio / 32) * 32, round(w / 32) * 32


class QwenImageEditAdapter(QwenImageAdapter):
    name = "qwen_image_edit"
    edits = True
    pipeline_class = "QwenImageEditPipeline"
    published = QWEN_IMAGE_EDIT

    @classmethod
    def condition_area(cls, model) -> int:
        """The tiny preset conditions at the output's own area (the 1024^2 of the real pipeline would be
        16k tokens on a 32x32 sample); a checkpoint at the pipeline's."""
        if model.pretrained is None and model.preset == "tiny":
            return model.height * model.width
        return CONDITION_AREA

    def build_preset(self, preset: str) -> None:
        super().build_preset(preset)
        self.image_token = ImageToken(self.transformer.config.joint_attention_dim)

    def build_pretrained(self, path: Path) -> None:
        from diffusers import QwenImageEditPipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers Qwen-Image-Edit checkpoint "
                "(no model_index.json)"
            )
        # Qwen2.5-VL and its processor (a component saved as null loads as None); without torchvision,
        # the processor without its video half (adapters/qwen_vl_processor.py)
        parts = absent_components(path)
        if "processor" not in parts:
            from digenrl.adapters.qwen_vl_processor import processor_without_video

            parts.update(processor_without_video(path))
        self.pipe = QwenImageEditPipeline.from_pretrained(path, torch_dtype=self.dtype, **parts)
        self.place_pipe()
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = None

    def check_shapes(self) -> None:
        super().check_shapes()
        h, w = condition_size(self.condition_area(self.cfg), self.cfg.height, self.cfg.width)
        if not (h and w):  # the tiny preset conditions at the output's area: each side rounds to 32
            raise UserError(
                f"model.height/width: Qwen-Image-Edit's conditioning rounds each side to a multiple of 32; "
                f"{self.cfg.height}x{self.cfg.width} rounds to {h}x{w}"
            )

    # ------------------------------------------------------------------ cost
    @classmethod
    def tokens(cls, model, transformer_config, vae_config) -> Tokens:
        t = super().tokens(model, transformer_config, vae_config)
        s = cls.vae_factors(vae_config)[0]
        h, w = condition_size(cls.condition_area(model), model.height, model.width)
        return Tokens(t.x + (h // s // 2) * (w // s // 2), t.text, t.latent_elements, t.pixels)

    # ------------------------------------------------------------------ hooks
    def condition_grid(self) -> tuple[int, int]:
        h, w = condition_size(self.condition_area(self.cfg), self.cfg.height, self.cfg.width)
        return h // self.vae_scale // 2, w // self.vae_scale // 2

    def encode_prompts(self, prompts: list[str], images: list[str | None] | None = None) -> Cond:
        if images is None or None in images:
            raise ValueError(
                "qwen_image_edit encodes an (instruction, input image) pair: an image per prompt"
            )
        h, w = condition_size(self.condition_area(self.cfg), self.cfg.height, self.cfg.width)
        pil = [read_image(p) for p in images]
        pixels = preprocess(pil, self.vae_scale, h, w)  # (B, 3, h, w) in [-1, 1]
        shown = [self.pipe.image_processor.resize(img, h, w) for img in pil] if self.pipe else pixels
        embeds, mask = self._encode_with(prompts, shown)
        batched = {"prompt_embeds": embeds, "mask": mask, "image_latents": self.encode_images(pixels)}
        host = {"text_len": valid_lengths(mask)}
        if self.sampling.guidance > 1:  # the pipeline encodes the negative prompt with the image too
            neg, neg_mask = self._encode_with([self.sampling.negative_prompt or " "] * len(prompts), shown)
            batched["neg_prompt_embeds"], batched["neg_mask"] = neg, neg_mask
            host["neg_text_len"] = valid_lengths(neg_mask)
        return Cond(batched, host=host)

    def _encode_with(self, prompts: list[str], shown) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds, mask) of the instructions with the image they refer to, padded to ``max_text_len``:
        the pipeline's Qwen2.5-VL encoder, or the tiny stand-in (an image token, then the words)."""
        L = self.cfg.max_text_len
        if self.pipe is None:
            t = self.text(prompts)
            embeds = torch.cat([self.image_token(shown), t["embeds"]], dim=1)[:, :L]
            mask = torch.cat([torch.ones(len(prompts), 1, dtype=torch.long), t["mask"]], dim=1)[:, :L]
            return embeds.to(self.device), mask.to(self.device)
        with torch.no_grad():
            embeds, mask = self.pipe.encode_prompt(prompt=prompts, image=shown, device=self.device)
        if embeds.shape[1] > L:
            raise UserError(
                f"model.max_text_len: {L} tokens, but the instruction and its image take {embeds.shape[1]}"
            )
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
        pad = L - embeds.shape[1]
        return F.pad(embeds, (0, 0, 0, pad)), F.pad(mask.long(), (0, pad))

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Packed, normalised image latents (B, tokens, 4C), fp32, as ``QwenImageEditPipeline``."""
        vc = self.vae.config
        x = pixels[:, :, None].to(self.device, self.vae.dtype)  # one frame
        latents = self.vae.encode(x).latent_dist.mode()
        mean = torch.tensor(vc.latents_mean).view(1, vc.z_dim, 1, 1, 1).to(latents)
        std = torch.tensor(vc.latents_std).view(1, vc.z_dim, 1, 1, 1).to(latents)
        return pack(((latents - mean) / std)[:, :, 0]).float()

    def img_shapes(self, batch: int) -> list[list[tuple[int, int, int]]]:
        return [[(1, *self._grid()), (1, *self.condition_grid())]] * batch

    def forward_pass(self, latents, t, inputs):
        n = latents.shape[1]
        return super().forward_pass(torch.cat([latents, inputs["image_latents"]], dim=1), t, inputs)[:, :n]

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        return {**super().pass_inputs(cond, negative), "image_latents": cond.batched["image_latents"]}
