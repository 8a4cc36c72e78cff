"""Pictures people can look at: captioned image grids (PNG) and short clips (GIF), with Pillow only.

Captions use the first installed TrueType font that covers the caption (DejaVu Sans covers Latin,
Greek, Cyrillic, Arabic, Hebrew; Noto CJK, where installed, adds Chinese / Japanese / Korean); a
character no installed font has is drawn as ``?`` -- never as an empty box -- and Pillow's own
bitmap font is the last resort when no TrueType font is installed at all.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

#: caption fonts in order of preference; those not installed on this machine are skipped
FONT_CANDIDATES = (
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",
    "/usr/share/fonts/noto-cjk/NotoSansCJK-Regular.ttc",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial Unicode.ttf",
    "C:/Windows/Fonts/arialuni.ttf",
)
CAPTION_PX = 11
TILE_GAP = 2  # pixels between any two tiles
GROUP_GAP = 14  # pixels between groups of tiles (a checkpoint + its baseline in compare.png)


@lru_cache(maxsize=1)
def caption_fonts() -> tuple:
    """The installed caption fonts (FreeTypeFont), best first; Pillow's bitmap font when none is."""
    fonts = []
    for path in FONT_CANDIDATES:
        try:
            fonts.append(ImageFont.truetype(path, CAPTION_PX))
        except OSError:
            continue
    return tuple(fonts) or (ImageFont.load_default(),)


def _has_glyph(font, ch: str) -> bool:
    """Whether ``font`` draws ``ch`` with a glyph of its own (not the .notdef box)."""
    if ch.isspace() or not isinstance(font, ImageFont.FreeTypeFont):
        return ch.isspace() or ch.isascii()
    return _glyph(font, ch) != _glyph(font, "\U0010fffd")  # a private-use code point: no font has it


def _glyph(font, ch: str) -> bytes:
    img = Image.new("L", (2 * CAPTION_PX, 2 * CAPTION_PX))
    ImageDraw.Draw(img).text((0, 0), ch, font=font, fill=255)
    return img.tobytes()


def caption_font(text: str):
    """(font, text to draw): the first font that covers every character; else the first font with
    each uncovered character replaced by ``?``."""
    fonts = caption_fonts()
    for font in fonts:
        if all(_has_glyph(font, ch) for ch in set(text)):
            return font, text
    font = fonts[0]
    return font, "".join(ch if _has_glyph(font, ch) else "?" for ch in text)


#: a caption is cut to this many characters before it reaches Pillow (a tile shows ~30 of them; Pillow
#: refuses a string of millions, and measuring a long one character by character takes quadratic time)
MAX_CAPTION_CHARS = 200


def caption_text(text: str) -> str:
    """A caption Pillow can draw on one line: control characters become spaces, at most
    ``MAX_CAPTION_CHARS`` characters (an ellipsis marks the cut)."""
    text = "".join(" " if ord(ch) < 32 or ord(ch) == 127 else ch for ch in str(text)[: MAX_CAPTION_CHARS + 1])
    return text if len(text) <= MAX_CAPTION_CHARS else text[: MAX_CAPTION_CHARS - 1] + "…"


def _fit(font, text: str, width: int) -> str:
    """``text`` cut (with an ellipsis) to fit ``width`` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def _to_pil(img: torch.Tensor, scale: int) -> Image.Image:
    """(3, H, W) uint8 or float in [0,1] -> PIL, upscaled by an integer factor (nearest, crisp pixels)."""
    if img.dtype != torch.uint8:
        img = (img.clamp(0, 1) * 255).round().to(torch.uint8)
    pil = Image.fromarray(img.permute(1, 2, 0).cpu().numpy())
    return pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST) if scale > 1 else pil


def _scale_for(h: int) -> int:
    return max(1, 128 // h)


def image_grid(images: torch.Tensor, captions: list[str], cols: int = 4, group: int = 1) -> Image.Image:
    """Images (N, 3, H, W) in a grid, each with its caption underneath; ``group`` consecutive columns
    form a group (e.g. 2: a checkpoint's sample and its baseline's), with a wider gap between groups."""
    n = len(images)
    scale = _scale_for(images.shape[-2])
    tiles = [_to_pil(im, scale) for im in images]
    tw, th, cap = tiles[0].width, tiles[0].height, CAPTION_PX + 5
    cols = min(cols, n)
    rows = (n + cols - 1) // cols
    xs = [c * (tw + TILE_GAP) + (c // group) * (GROUP_GAP - TILE_GAP) for c in range(cols)]
    grid = Image.new("RGB", (xs[-1] + tw, rows * (th + cap + TILE_GAP) - TILE_GAP), "white")
    draw = ImageDraw.Draw(grid)
    for i, (tile, text) in enumerate(zip(tiles, captions)):
        x, y = xs[i % cols], (i // cols) * (th + cap + TILE_GAP)
        grid.paste(tile, (x, y))
        font, drawn = caption_font(caption_text(text))
        draw.text((x + 2, y + th + 1), _fit(font, drawn, tw - 4), fill="black", font=font)
    return grid


def save_samples(pixels: torch.Tensor, captions: list[str], path: Path, group: int = 1) -> Path:
    """Images -> ``path.png`` grid; videos (N, 3, F, H, W) -> ``path.gif`` of grids, one per frame."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if pixels.ndim == 4:
        out = path.with_suffix(".png")
        image_grid(pixels, captions, group=group).save(out)
        return out
    frames = [image_grid(pixels[:, :, f], captions, group=group) for f in range(pixels.shape[2])]
    out = path.with_suffix(".gif")
    frames[0].save(out, save_all=True, append_images=frames[1:], duration=200, loop=0)
    return out
