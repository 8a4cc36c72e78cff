"""Captioned grids: gaps between tiles and between compared pairs, captions in non-Latin scripts."""

import torch

from digenrl.run.media import GROUP_GAP, TILE_GAP, _has_glyph, caption_font, caption_fonts, image_grid


def test_captions_never_draw_empty_boxes():
    font = caption_fonts()[0]
    assert _has_glyph(font, "a") and not _has_glyph(font, "\U0010fffd")
    for text in ("a red apple", "красное яблоко", "κόκκινο μήλο", "红色的苹果"):
        chosen, drawn = caption_font(text)
        assert len(drawn) == len(text)
        # every character is drawn with a glyph of the chosen font, or replaced by a visible '?'
        assert all(_has_glyph(chosen, d) or d == c == " " for c, d in zip(text, drawn))
        assert all(d == c or d == "?" for c, d in zip(text, drawn))


def test_compare_grid_separates_pairs():
    black = torch.zeros(4, 3, 32, 32)  # 32 px tiles are drawn at 4x: 128 px
    grid = image_grid(black, ["a", "b", "c", "d"], cols=4, group=2)
    assert grid.width == 4 * 128 + 2 * TILE_GAP + GROUP_GAP
    row = [grid.getpixel((x, 10)) for x in range(grid.width)]
    white = [x for x, px in enumerate(row) if px == (255, 255, 255)]
    # the gap inside a pair is TILE_GAP wide, the gap between pairs GROUP_GAP wide
    assert white == list(range(128, 128 + TILE_GAP)) + list(
        range(256 + TILE_GAP, 256 + TILE_GAP + GROUP_GAP)
    ) + list(range(384 + TILE_GAP + GROUP_GAP, 384 + 2 * TILE_GAP + GROUP_GAP))
