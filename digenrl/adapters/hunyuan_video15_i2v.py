"""HunyuanVideo-1.5 image to video: HunyuanVideo-1.5 conditioned on a first frame, through the edit
families' input-image path (every prompt row names its image; adapters/edit.py).

Mirrors ``diffusers.HunyuanVideo15ImageToVideoPipeline``: the output size is the ``target_size``
bucket of the image's aspect ratio (here the image is the output's size, which must be its own bucket);
the image, resized and normalised by the pipeline's ``HunyuanVideo15ImageProcessor``, is encoded by the
VAE to its latent mode times the scaling factor and put in the condition latents' first frame (zeros
after it) with a mask of ones on that frame; SigLIP's last hidden state of the image (its own processor's
resize) is the transformer's image embeddings, attended in both guidance passes. Text, schedule, CFG
and decode are text-to-video's (adapters/hunyuan_video15.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from digenrl.adapters.base import seeded
from digenrl.adapters.cond import Cond
from digenrl.adapters.edit import absent_components, read_image
from digenrl.adapters.hunyuan_video15 import (
    HUNYUAN_VIDEO15,
    TINY_TRANSFORMER,
    TINY_VAE,
    HunyuanVideo15Adapter,
)
from digenrl.errors import UserError

#: the tiny transformer at i2v, its buckets at 16 px (4x4 latent patches: 16x16, 12x16, 16x12, ...)
TINY_I2V_TRANSFORMER = dict(TINY_TRANSFORMER, task_type="i2v", target_size=16)
#: a tiny SigLIP vision tower with the real one's 729 (27 x 27) tokens; width = the image_embed_dim
TINY_SIGLIP = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=54,
    patch_size=2,
)

# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v: the t2v transformer at task_type i2v
# (diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py, TRANSFORMER_CONFIGS["480p_i2v"]; the same
# shift 5 and guidance 6), and SigLIP so400m-patch14-384 (0.43B) as its image encoder
HUNYUAN_VIDEO15_I2V = replace(
    HUNYUAN_VIDEO15,
    label="HunyuanVideo-1.5 I2V (8.3B)",
    transformer=dict(HUNYUAN_VIDEO15.transformer, task_type="i2v"),
    text_encoder_params=HUNYUAN_VIDEO15.text_encoder_params + 0.43e9,
)


class HunyuanVideo15I2VAdapter(HunyuanVideo15Adapter):
    name = "hunyuan_video15_i2v"
    edits = True
    pipeline_class = "HunyuanVideo15ImageToVideoPipeline"
    published = HUNYUAN_VIDEO15_I2V
    presets = {"tiny": (TINY_I2V_TRANSFORMER, TINY_VAE)}
    GENERATION_PIPE_PARTS = HunyuanVideo15Adapter.GENERATION_PIPE_PARTS + (
        "image_encoder",
        "feature_extractor",
    )

    def build_preset(self, preset: str) -> None:
        from transformers import SiglipVisionConfig, SiglipVisionModel

        try:  # transformers 5: the PIL processor, what it falls back to without torchvision
            from transformers import SiglipImageProcessorPil as SiglipImageProcessor
        except ImportError:
            from transformers import SiglipImageProcessor
        super().build_preset(preset)
        side = TINY_SIGLIP["image_size"]
        with seeded(4321):
            self.image_encoder = SiglipVisionModel(SiglipVisionConfig(**TINY_SIGLIP)).eval()
        self.feature_extractor = SiglipImageProcessor(size={"height": side, "width": side})

    def build_pretrained(self, path: Path) -> None:
        from diffusers import HunyuanVideo15ImageToVideoPipeline

        if not (path / "model_index.json").is_file():
            raise UserError(
                f"model.pretrained: {path} is not a diffusers HunyuanVideo-1.5 image-to-video checkpoint "
                "(no model_index.json)"
            )
        self.pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(
            path, torch_dtype=self.dtype, **absent_components(path)
        )
        self.pipe.tokenizer_max_length = self.pipe.tokenizer_2_max_length = self.cfg.max_text_len
        self.place_pipe()
        self.transformer, self.vae, self.scheduler = self.pipe.transformer, self.pipe.vae, self.pipe.scheduler
        self.text = self.byt5 = None
        self.image_encoder, self.feature_extractor = self.pipe.image_encoder, self.pipe.feature_extractor

    def release_generation_modules(self) -> None:
        super().release_generation_modules()
        self.image_encoder = self.feature_extractor = None

    def buckets(self) -> tuple[int, int]:
        """(target_size, the VAE's spatial factor): the checkpoint's transformer config, or the tiny's."""
        if self.cfg.pretrained is None:
            return TINY_I2V_TRANSFORMER["target_size"], TINY_VAE["spatial_compression_ratio"]
        config = Path(self.cfg.pretrained) / "transformer" / "config.json"
        target = json.loads(config.read_text()).get("target_size", 640) if config.is_file() else 640
        return target, 16

    def image_processor(self):
        """The pipeline's ``video_processor`` (resize and normalise, no rounding)."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        return HunyuanVideo15ImageProcessor(vae_scale_factor=self.buckets()[1], do_resize=False)

    def check_shapes(self) -> None:
        super().check_shapes()
        h, w = self.cfg.height, self.cfg.width
        target = self.buckets()[0]
        bucket = tuple(self.image_processor().calculate_default_height_width(h, w, target))
        if bucket != (h, w):
            raise UserError(
                f"model.height/width: HunyuanVideo-1.5 image-to-video generates at the bucket of its input "
                f"image's aspect ratio (target_size {target}); a {h}x{w} image gives "
                f"{bucket[0]}x{bucket[1]}: use that size"
            )

    # ------------------------------------------------------------------ hooks
    def encode_prompts(self, prompts: list[str], images: list[str | None] | None = None) -> Cond:
        if images is None or None in images:
            raise ValueError("hunyuan_video15_i2v encodes a (prompt, first frame) pair: an image per prompt")
        cond = super().encode_prompts(prompts)
        cond.batched["image_latents"], cond.batched["image_embeds"] = self.encode_images(images)
        return cond

    @torch.no_grad()
    def encode_images(self, paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(first-frame latents (B, C, 1, h, w), SigLIP embeddings (B, 729, D)), fp32, as the pipeline's
        ``_get_image_latents`` and ``_get_image_embeds``."""
        h, w = self.cfg.height, self.cfg.width
        proc = self.image_processor()
        images = [proc.resize(read_image(p), height=h, width=w, resize_mode="crop") for p in paths]
        pixels = proc.preprocess(images, height=h, width=w).to(self.device, self.vae.dtype)
        latents = self.vae.encode(pixels[:, :, None]).latent_dist.mode() * self.vae.config.scaling_factor
        shown = self.feature_extractor.preprocess(
            images=images, do_resize=True, return_tensors="pt", do_convert_rgb=True
        )
        at = next(self.image_encoder.parameters())  # the tiny SigLIP stays on the CPU, as the tiny LM
        embeds = self.image_encoder(**shown.to(device=at.device, dtype=at.dtype)).last_hidden_state
        return latents.float(), embeds.float().to(self.device)

    def pass_inputs(self, cond: Cond, negative: bool) -> dict[str, torch.Tensor]:
        # the pipeline passes the same image to both of the guider's passes
        keys = ("image_latents", "image_embeds")
        return {**super().pass_inputs(cond, negative), **{k: cond.batched[k] for k in keys}}

    def condition(self, x: torch.Tensor, inputs: dict[str, torch.Tensor]):
        """The image's latents in the first frame, zeros after it; a mask of ones on the first frame."""
        first = inputs["image_latents"].to(x.dtype)
        rest = torch.zeros_like(x[:, :, 1:])
        mask = torch.zeros_like(x[:, :1])
        mask[:, :, 0] = 1.0
        return torch.cat([first, rest], dim=2), mask, inputs["image_embeds"].to(x.dtype)
