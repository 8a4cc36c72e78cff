"""A weight-free reward that needs spatial structure: ``prompt_shape`` (the learning benchmark's second
task, harder than ``prompt_color``).

Details: docs/modules.md, `digenrl.rewards.structure`.
"""

from __future__ import annotations

import torch

from digenrl.rewards.base import Reward, register
from digenrl.rewards.basic import COLORS, prompt_color

SHAPES = ("disc", "square", "ring", "hbar", "vbar", "cross")
GROUND = 0.5  # the gray everywhere outside the shape


def shape_of(prompt: str, meta: dict) -> str:
    """metadata 'shape' if given, else the shape the prompt's last word picks (sum of its character
    codes mod 6: the same word always the same shape, independent of any hash seed)."""
    if meta.get("shape"):
        return meta["shape"]
    word = prompt.lower().replace(",", " ").split()[-1]
    return SHAPES[sum(map(ord, word)) % len(SHAPES)]


def shape_mask(shape: str, h: int, w: int) -> torch.Tensor:
    """(h, w) bool: where the shape is, drawn on pixel centres in [-1, 1]^2."""
    y = (torch.arange(h, dtype=torch.float32) + 0.5) / h * 2 - 1
    x = (torch.arange(w, dtype=torch.float32) + 0.5) / w * 2 - 1
    yy, xx = torch.meshgrid(y, x, indexing="ij")
    r = (yy**2 + xx**2).sqrt()
    masks = {
        "disc": r < 0.6,
        "square": (yy.abs() < 0.5) & (xx.abs() < 0.5),
        "ring": (r > 0.4) & (r < 0.8),
        "hbar": yy.abs() < 0.3,
        "vbar": xx.abs() < 0.3,
        "cross": (yy.abs() < 0.2) | (xx.abs() < 0.2),
    }
    return masks[shape]


def target_image(color: str, shape: str, h: int, w: int) -> torch.Tensor:
    """(3, h, w): the shape in the colour on the gray ground."""
    rgb = torch.tensor(COLORS[color], dtype=torch.float32)[:, None, None]
    return torch.where(shape_mask(shape, h, w), rgb, torch.full((3, 1, 1), GROUND))


@register("prompt_shape")
class PromptShape(Reward):
    """1 - mean per-pixel RGB distance to the prompt's coloured shape on gray, normalised to [0, 1]."""

    def score(self, images, prompts, metadata):
        h, w = images.shape[-2:]
        target = torch.stack(
            [target_image(prompt_color(p, m), shape_of(p, m), h, w) for p, m in zip(prompts, metadata)]
        )
        dist = (images.float().cpu() - target).norm(dim=1) / 3**0.5
        return 1 - dist.mean(dim=(1, 2))
