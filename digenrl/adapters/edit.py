"""Image editing (FLUX.1 Kontext, Qwen-Image-Edit): the input image of a prompt row as the edit
pipelines encode it.

A prompt row of an edit family names an image (``data/prompts.py``); it is read here, resized and
normalised by diffusers' own ``VaeImageProcessor`` and encoded by the family's VAE to the latent
mode (the pipelines' ``retrieve_latents(..., sample_mode="argmax")``), then packed 2x2 into tokens that
the transformer sees after the noisy latents. Both pipelines keep only the first ``N`` output tokens.
"""

from __future__ import annotations

import torch


def read_image(path: str):
    """The image at ``path`` as an RGB PIL image, fully decoded (a truncated file raises here)."""
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return img.convert("RGB")


def image_problem(path: str, size: tuple[int, int]) -> str | None:
    """Why the image at ``path`` cannot condition a ``size`` = (height, width) sample, or None."""
    try:
        img = read_image(path)
    except FileNotFoundError:
        return f"image not found: {path}"
    except (OSError, ValueError, SyntaxError) as e:  # PIL: UnidentifiedImageError, truncated data
        return f"image unreadable: {path} ({type(e).__name__})"
    if (img.height, img.width) != tuple(size):
        return (
            f"image {path} is {img.height}x{img.width}, the model generates {size[0]}x{size[1]} "
            "(model.height x model.width): resize it"
        )
    return None


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2*W/2, 4C): 2x2 patches as tokens (the pipelines' ``_pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def preprocess(images: list, vae_scale: int, height: int, width: int) -> torch.Tensor:
    """PIL images -> (B, 3, height, width) in [-1, 1], as the edit pipelines resize and normalise them."""
    from diffusers.image_processor import VaeImageProcessor

    proc = VaeImageProcessor(vae_scale_factor=vae_scale * 2)
    resized = [proc.resize(img, height, width) for img in images]
    return proc.preprocess(resized, height, width)


def absent_components(path) -> dict:
    """The components a checkpoint saved as null (e.g. no text encoder), to pass as None when loading."""
    import json

    index = json.loads((path / "model_index.json").read_text())
    return {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None}


def image_key(prompt: str, image: str | None) -> str:
    """The prompt cache's key of an (instruction, image) pair (a prompt never holds a NUL)."""
    return prompt if image is None else f"{prompt}\0{image}"


def split_key(key: str) -> tuple[str, str | None]:
    text, _, image = key.partition("\0")
    return text, image or None


class ImageToken:
    """The tiny presets' stand-in for a vision-language encoder's view of the image: one token, a
    fixed random map of the image's mean colour, put in front of the prompt's word embeddings."""

    def __init__(self, dim: int, seed: int = 17):
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(dim, 3, generator=g)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, 1, dim)."""
        return (pixels.float().mean(dim=(2, 3)) @ self.weight.T)[:, None]
