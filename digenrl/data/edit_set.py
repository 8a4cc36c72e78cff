"""The tiny edit prompt set the edit families' tiny configs train on: solid-colour input images (PNG)
and a ``prompts.jsonl`` of (instruction, image) rows. Two are shipped beside the configs
(``configs/edits/tiny_16``, ``tiny_32``: the tiny FLUX.1 Kontext and Qwen-Image-Edit sizes), written by

    python -m digenrl.data.edit_set configs/edits/tiny_16 16 16
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: the colours of the tiny edit set's input images (RGB 0-255)
EDIT_COLOURS = {"red": (230, 30, 30), "blue": (30, 40, 230), "green": (20, 160, 40), "yellow": (230, 220, 30)}
#: (instruction, input image colour): each asks for the colour the image does not have
ROWS = [("make it red", "blue"), ("make it blue", "red")]


def write_edit_set(folder: Path, height: int, width: int, rows=None) -> Path:
    """Write the set into ``folder`` (``images/<colour>.png`` of ``height`` x ``width`` and
    ``prompts.jsonl`` naming them relative to itself); ``rows``: (instruction, source colour) pairs
    (default :data:`ROWS`). Returns the .jsonl path."""
    from PIL import Image

    rows = rows or ROWS
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for colour in sorted({c for _, c in rows}):
        Image.new("RGB", (width, height), EDIT_COLOURS[colour]).save(folder / "images" / f"{colour}.png")
    lines = [json.dumps({"prompt": text, "image": f"images/{colour}.png"}) for text, colour in rows]
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "prompts.jsonl"


if __name__ == "__main__":
    write_edit_set(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
