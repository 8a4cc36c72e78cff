"""The small world's detector: pixels to GenEval detections (``{class: [{"box", "score", "color"}]}``).

A pixel is foreground where its brightest channel passes ``FOREGROUND``; its colour is the palette
colour nearest in direction (hue, not brightness: a blurred edge keeps its colour), ``other`` when
none is within ``MIN_COSINE``. Each 4-connected component of one colour of at least ``MIN_AREA`` pixels
is an object; its shape follows from where its mass sits (a triangle, apex up, is bottom-heavy), how
much of its box it fills, and whether it fills its box's corners (a square). Details: docs/smallworld.md.
"""

from __future__ import annotations

import numpy as np

from digenrl.rewards.smallworld.world import COLORS

FOREGROUND = 0.35
MIN_COSINE = 0.9
MIN_AREA = 12
_NAMES = list(COLORS) + ["other"]
_DIRS = np.array([c for c in COLORS.values()], np.float32)
_DIRS /= np.linalg.norm(_DIRS, axis=1, keepdims=True)


def colour_labels(img: np.ndarray) -> np.ndarray:
    """(H, W) int: -1 background, else an index into the palette (``len(COLORS)``: other)."""
    fg = img.max(axis=2) > FOREGROUND
    unit = img / np.maximum(np.linalg.norm(img, axis=2, keepdims=True), 1e-6)
    cos = unit @ _DIRS.T
    label = np.where(cos.max(axis=2) >= MIN_COSINE, cos.argmax(axis=2), len(COLORS))
    return np.where(fg, label, -1)


def components(labels: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The 4-connected components of equal non-negative label: (label, ys, xs) each."""
    h, w = labels.shape
    seen = np.zeros_like(labels, bool)
    out = []
    for y0, x0 in zip(*np.nonzero(labels >= 0)):
        if seen[y0, x0]:
            continue
        lab, todo, ys, xs = labels[y0, x0], [(y0, x0)], [], []
        seen[y0, x0] = True
        while todo:
            y, x = todo.pop()
            ys.append(y)
            xs.append(x)
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and labels[ny, nx] == lab:
                    seen[ny, nx] = True
                    todo.append((ny, nx))
        out.append((int(lab), np.array(ys), np.array(xs)))
    return out


def shape_of(ys: np.ndarray, xs: np.ndarray) -> str:
    """triangle: its mass's centre in the lower 42% of its box (a drawn one: 63%), or it fills < 68% of
    the box (~60%); square: >= 12 of the 16 pixels of its box's four 2x2 corners lit (a drawn square
    16, a circle 0 to 4; through the VAE squares keep 9 to 16, circles 0 to 12); circle: otherwise."""
    y0, x0 = ys.min(), xs.min()
    mask = np.zeros((ys.max() - y0 + 1, xs.max() - x0 + 1), bool)
    mask[ys - y0, xs - x0] = True
    fill = mask.mean()
    centre = (ys.mean() - y0 + 0.5) / mask.shape[0]
    if centre >= 0.58 or fill < 0.68:
        return "triangle"
    corners = mask[:2, :2].sum() + mask[:2, -2:].sum() + mask[-2:, :2].sum() + mask[-2:, -2:].sum()
    return "square" if corners >= 12 else "circle"


def detect(img: np.ndarray) -> dict[str, list[dict]]:
    """Detections of one (H, W, 3) image in [0, 1], in GenEval's form; every object scores 1."""
    found: dict[str, list[dict]] = {}
    for lab, ys, xs in components(colour_labels(img)):
        if len(ys) < MIN_AREA:
            continue
        box = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
        obj = {"box": box, "score": 1.0, "color": _NAMES[lab]}
        found.setdefault(shape_of(ys, xs), []).append(obj)
    return found
