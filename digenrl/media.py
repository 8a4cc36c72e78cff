"""Pictures people can look at: captioned image grids (PNG) and short clips (GIF), with Pillow only."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw


def _to_pil(img: torch.Tensor, scale: int) -> Image.Image:
    """(3, H, W) uint8 or float in [0,1] -> PIL, upscaled by an integer factor (nearest, crisp pixels)."""
    if img.dtype != torch.uint8:
        img = (img.clamp(0, 1) * 255).round().to(torch.uint8)
    pil = Image.fromarray(img.permute(1, 2, 0).cpu().numpy())
    return pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST) if scale > 1 else pil


def _scale_for(h: int) -> int:
    return max(1, 128 // h)


def image_grid(images: torch.Tensor, captions: list[str], cols: int = 4) -> Image.Image:
    """Images (N, 3, H, W) in a grid, each with its caption underneath."""
    n = len(images)
    scale = _scale_for(images.shape[-2])
    tiles = [_to_pil(im, scale) for im in images]
    tw, th, cap = tiles[0].width, tiles[0].height, 14
    cols = min(cols, n)
    rows = (n + cols - 1) // cols
    grid = Image.new("RGB", (cols * tw, rows * (th + cap)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (tile, text) in enumerate(zip(tiles, captions)):
        x, y = (i % cols) * tw, (i // cols) * (th + cap)
        grid.paste(tile, (x, y))
        draw.text((x + 2, y + th + 1), text[: tw // 6], fill="black")
    return grid


def save_samples(pixels: torch.Tensor, captions: list[str], path: Path) -> Path:
    """Images -> ``path.png`` grid; videos (N, 3, F, H, W) -> ``path.gif`` of grids, one per frame."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if pixels.ndim == 4:
        out = path.with_suffix(".png")
        image_grid(pixels, captions).save(out)
        return out
    frames = [image_grid(pixels[:, :, f], captions) for f in range(pixels.shape[2])]
    out = path.with_suffix(".gif")
    frames[0].save(out, save_all=True, append_images=frames[1:], duration=200, loop=0)
    return out
