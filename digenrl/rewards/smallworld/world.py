"""The small world: 1-4 flat shapes of a few colours drawn on a 32x32 black canvas, captioned in
GenEval's six categories with GenEval's metadata row (``tag``, ``include``, ``exclude``) beside each
caption. Seeded: a scene is a function of its metadata row and its seed.

Details: docs/smallworld.md.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np

from digenrl.rewards.geneval import relations

SIZE = 32
SHAPES = ("circle", "square", "triangle")
COLORS = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.1),
    "blue": (0.15, 0.25, 0.95),
    "yellow": (0.95, 0.9, 0.1),
}
RELATIONS = ("left of", "right of", "above", "below")
NUMBERS = {2: "two", 3: "three", 4: "four"}
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
OBJECT_SIDES = (8, 11)  # an object's bounding square: 8 to 11 pixels a side
GAP = 2  # pixels between two objects' boxes (same-coloured neighbours stay separate components)


def _plural(shape: str) -> str:
    return shape + "s"


def _a(shape: str, color: str | None = None) -> str:
    return f"a {color} {shape}" if color else f"a {shape}"


def all_rows() -> list[dict]:
    """Every caption of the world with its GenEval metadata row, category by category."""
    rows = [
        {"tag": "single_object", "include": [{"class": s, "count": 1}], "prompt": f"a photo of {_a(s)}"}
        for s in SHAPES
    ]
    for a, b in itertools.combinations(SHAPES, 2):
        inc = [{"class": a, "count": 1}, {"class": b, "count": 1}]
        rows.append({"tag": "two_object", "include": inc, "prompt": f"a photo of {_a(a)} and {_a(b)}"})
    for s, n in itertools.product(SHAPES, NUMBERS):
        rows.append(
            {
                "tag": "counting",
                "include": [{"class": s, "count": n}],
                "exclude": [{"class": s, "count": n + 1}],
                "prompt": f"a photo of {NUMBERS[n]} {_plural(s)}",
            }
        )
    for s, c in itertools.product(SHAPES, COLORS):
        inc = [{"class": s, "count": 1, "color": c}]
        rows.append({"tag": "colors", "include": inc, "prompt": f"a photo of {_a(s, c)}"})
    for (a, b), rel in itertools.product(itertools.permutations(SHAPES, 2), RELATIONS):
        inc = [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]}]
        rows.append({"tag": "position", "include": inc, "prompt": f"a photo of {_a(a)} {rel} {_a(b)}"})
    for (a, b), (ca, cb) in itertools.product(
        itertools.permutations(SHAPES, 2), itertools.permutations(COLORS, 2)
    ):
        inc = [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}]
        prompt = f"a photo of {_a(a, ca)} and {_a(b, cb)}"
        rows.append({"tag": "color_attr", "include": inc, "prompt": prompt})
    return rows


def split_rows(seed: int = 0, held_out: float = 0.25) -> tuple[list[dict], list[dict]]:
    """(train, test) captions: per category a seeded ``held_out`` share of its captions is held out
    for evaluation; a category of fewer than 8 captions (single_object, two_object) is in both."""
    train, test = [], []
    rows = all_rows()
    for tag in TAGS:
        mine = [r for r in rows if r["tag"] == tag]
        if len(mine) < 8:
            train += mine
            test += mine
            continue
        order = random.Random(f"{seed}:{tag}").sample(range(len(mine)), len(mine))
        k = max(1, round(held_out * len(mine)))
        test += [mine[i] for i in sorted(order[:k])]
        train += [mine[i] for i in sorted(order[k:])]
    return train, test


# ---------------------------------------------------------------------------- drawing
def shape_mask(shape: str, side: int) -> np.ndarray:
    """(side, side) bool: the shape filling its bounding square, sampled at pixel centres."""
    c = (np.arange(side) + 0.5) / side * 2 - 1  # [-1, 1]
    yy, xx = np.meshgrid(c, c, indexing="ij")
    if shape == "circle":
        return xx**2 + yy**2 <= 1.0
    if shape == "square":
        return np.ones((side, side), bool)
    if shape == "triangle":  # apex up (its top row lit), base at the bottom
        return np.abs(xx) <= (yy + 1) / 2 + 1 / side
    raise ValueError(f"unknown shape {shape!r}")


def _place(
    rng: random.Random, sides: list[int], boxes: list[list[int]], tries: int = 200
) -> list[int] | None:
    side = sides[len(boxes)]
    for _ in range(tries):
        x0, y0 = rng.randint(1, SIZE - 1 - side), rng.randint(1, SIZE - 1 - side)
        box = [x0, y0, x0 + side, y0 + side]
        if all(
            box[0] >= b[2] + GAP or b[0] >= box[2] + GAP or box[1] >= b[3] + GAP or b[1] >= box[3] + GAP
            for b in boxes
        ):
            return box
    return None


def scene_objects(meta: dict, rng: random.Random) -> list[dict]:
    """Objects (``class``, ``color``, ``box`` [x0, y0, x1, y1], x1 / y1 exclusive) that satisfy the
    metadata row: each ``include`` clause's count of its class (its colour if named, else a random one),
    each ``position`` clause exactly its relation (GenEval's rule, and no second relation)."""
    want = [
        (r["class"], r.get("color"), r.get("position")) for r in meta["include"] for _ in range(r["count"])
    ]
    first_of = list(itertools.accumulate([0] + [r["count"] for r in meta["include"]]))
    while True:
        sides = [rng.randint(*OBJECT_SIDES) for _ in want]
        objs: list[dict] = []
        for cls, color, position in want:
            box = _place(rng, sides, [o["box"] for o in objs])
            if box is None:
                break
            if position is not None:
                target = objs[first_of[position[1]]]["box"]
                if relations(box, target) != {position[0]}:
                    break
            objs.append({"class": cls, "color": color or rng.choice(list(COLORS)), "box": box})
        if len(objs) == len(want):
            return objs


def draw(objects: list[dict]) -> np.ndarray:
    """(SIZE, SIZE, 3) float32 in [0, 1]: the objects on black."""
    img = np.zeros((SIZE, SIZE, 3), np.float32)
    for o in objects:
        x0, y0, x1, y1 = o["box"]
        mask = shape_mask(o["class"], x1 - x0)
        img[y0:y1, x0:x1][mask] = COLORS[o["color"]]
    return img


def sample_scene(meta: dict, seed: int) -> tuple[np.ndarray, list[dict]]:
    """One drawn image of a caption's metadata row and its objects, a function of ``seed``."""
    objs = scene_objects(meta, random.Random(f"{meta['prompt']}:{seed}"))
    return draw(objs), objs


def write_prompt_sets(folder, seed: int = 0) -> None:
    """``folder``/train_metadata.jsonl and test_metadata.jsonl (:func:`split_rows`): a prompt set in
    Flow-GRPO's GenEval layout, one metadata row a line."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(("train", "test"), split_rows(seed)):
        (folder / f"{name}_metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
