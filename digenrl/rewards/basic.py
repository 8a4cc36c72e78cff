"""Weight-free rewards: JPEG (in)compressibility (as in DDPO), prompt colour, and an edit's similarity to
its input image."""

from __future__ import annotations

import io
from collections import OrderedDict

import numpy as np
import torch
from PIL import Image

from digenrl.adapters.edit import read_image
from digenrl.errors import UserError
from digenrl.rewards.base import Reward, register


def _jpeg_kb(images: torch.Tensor, quality: int) -> torch.Tensor:
    sizes = []
    for img in images:
        arr = (img.clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000)
    return torch.tensor(sizes)


@register("jpeg_incompressibility")
class JpegIncompressibility(Reward):
    """JPEG size in kB at the given quality: busier images score higher."""

    def __init__(self, quality: int = 95):
        self.quality = quality

    def score(self, images, prompts, metadata):
        return _jpeg_kb(images, self.quality)


@register("jpeg_compressibility")
class JpegCompressibility(JpegIncompressibility):
    """Negative JPEG size in kB: simpler images score higher."""

    def score(self, images, prompts, metadata):
        return -_jpeg_kb(images, self.quality)


COLORS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 0.6, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "orange": (1.0, 0.5, 0.0),
    "purple": (0.5, 0.0, 0.5),
    "pink": (1.0, 0.6, 0.75),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
    "cyan": (0.0, 1.0, 1.0),
    "brown": (0.55, 0.3, 0.1),
}


def prompt_color(prompt: str, meta: dict) -> str:
    """The colour a sample should have: metadata 'color' if given, else the first colour word in the
    prompt."""
    if meta.get("color"):
        return meta["color"]
    for word in prompt.lower().replace(",", " ").split():
        if word in COLORS:
            return word
    raise UserError(f"reward prompt_color: prompt {prompt!r} names no colour (known: {', '.join(COLORS)})")


@register("prompt_color")
class PromptColor(Reward):
    """1 - mean per-pixel RGB distance to the colour the prompt names, normalised to [0, 1]."""

    def score(self, images, prompts, metadata):
        target = torch.tensor(
            [COLORS[prompt_color(p, m)] for p, m in zip(prompts, metadata)], dtype=torch.float32
        )
        dist = (images.float().cpu() - target[:, :, None, None]).norm(dim=1) / 3**0.5
        return 1 - dist.mean(dim=(1, 2))


@register("source_similarity")
class SourceSimilarity(Reward):
    """An edit's faithfulness to its input image: 1 - the mean per-pixel RGB distance between the result
    and the prompt row's input image (``metadata['image']``, resized to the result), in [0, 1]."""

    CACHED = 64  # input images held (uint8), most recently used: a group's samples share one

    def __init__(self):
        self.sources: OrderedDict[str, torch.Tensor] = OrderedDict()  # path -> (3, H, W) uint8

    def source(self, meta: dict, size: tuple[int, int]) -> torch.Tensor:
        path = meta.get("image")
        if path is None:
            raise UserError(
                "reward source_similarity: a prompt row has no input image ('image' in its .jsonl row)"
            )
        if path not in self.sources:
            self.sources[path] = torch.from_numpy(np.asarray(read_image(path)).copy()).permute(2, 0, 1)
            while len(self.sources) > self.CACHED:
                self.sources.popitem(last=False)
        self.sources.move_to_end(path)
        src = self.sources[path].float() / 255
        if tuple(src.shape[1:]) != size:
            src = torch.nn.functional.interpolate(src[None], size=size, mode="bilinear", antialias=True)[0]
        return src

    def score(self, images, prompts, metadata):
        size = tuple(images.shape[2:])
        target = torch.stack([self.source(m, size) for m in metadata])
        dist = (images.float().cpu() - target).norm(dim=1) / 3**0.5
        return 1 - dist.mean(dim=(1, 2))
