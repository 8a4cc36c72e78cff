"""The small world (digenrl/rewards/smallworld): the generator's captions are GenEval metadata rows,
the detector finds exactly the objects the generator drew, and the ``smallworld`` reward applies
GenEval's rules (digenrl/rewards/geneval.py) to them, on hand-made images."""

import collections

import numpy as np
import pytest
import torch

from digenrl.config.train import RewardConfig
from digenrl.errors import UserError
from digenrl.rewards import build_reward
from digenrl.rewards.geneval import relations
from digenrl.rewards.smallworld.detect import detect
from digenrl.rewards.smallworld.world import COLORS, TAGS, all_rows, draw, sample_scene, split_rows
from tests.helpers import run_benchmark_here


def row(prompt):
    return next(r for r in all_rows() if r["prompt"] == prompt)


def reward(score="correct"):
    return build_reward(RewardConfig(components=[{"name": "smallworld", "args": {"score": score}}]))


def pixels(*images):
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)


def objects_of(detections):
    return sorted((cls, o["color"], tuple(o["box"])) for cls, objs in detections.items() for o in objs)


def test_captions_are_geneval_rows_and_the_split_holds_out_prompts():
    rows = all_rows()
    assert collections.Counter(r["tag"] for r in rows) == {
        "single_object": 3,
        "two_object": 3,
        "counting": 9,
        "colors": 12,
        "position": 24,
        "color_attr": 72,
    }
    assert row("a photo of three circles")["exclude"] == [{"class": "circle", "count": 4}]
    assert row("a photo of a square left of a circle")["include"] == [
        {"class": "circle", "count": 1},
        {"class": "square", "count": 1, "position": ["left of", 0]},
    ]
    train, test = split_rows()
    for tag in TAGS:
        a = {r["prompt"] for r in train if r["tag"] == tag}
        b = {r["prompt"] for r in test if r["tag"] == tag}
        assert (a == b) if tag in ("single_object", "two_object") else (b and not a & b), tag
    assert split_rows() == (train, test) and split_rows(seed=1) != (train, test)


def test_the_detector_finds_what_the_generator_drew_and_the_rules_agree():
    """Every held-out caption, 4 seeds: the detections are the drawn objects (class, colour, box) and
    GenEval's verdict on them is correct; a position row's objects stand in exactly its relation."""
    rules = reward().terms[0][2]
    for meta in split_rows()[1]:
        for seed in range(4):
            img, objs = sample_scene(meta, seed)
            assert objects_of(detect(img)) == sorted((o["class"], o["color"], tuple(o["box"])) for o in objs)
            assert rules.score(pixels(img), [meta["prompt"]], [meta]).item() == 1.0, meta["prompt"]
            if meta["tag"] == "position":
                assert relations(objs[1]["box"], objs[0]["box"]) == {meta["include"][1]["position"][0]}
    a, _ = sample_scene(row("a photo of four triangles"), 3)
    b, _ = sample_scene(row("a photo of four triangles"), 3)
    c, _ = sample_scene(row("a photo of four triangles"), 4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_detector_hand_cases():
    img = draw([{"class": "square", "color": "red", "box": [2, 2, 10, 10]}])
    img[20:30, 20:30] = np.array(COLORS["yellow"]) * 0.5  # a dim (blurred) yellow: still yellow
    img[0, 30] = img[1, 30] = (1, 1, 1)  # a 2-pixel speck: below MIN_AREA, nothing
    img[12:22, 2:12] = (1, 1, 1)  # white: a square of no palette colour
    assert objects_of(detect(img)) == [
        ("square", "other", (2, 12, 12, 22)),
        ("square", "red", (2, 2, 10, 10)),
        ("square", "yellow", (20, 20, 30, 30)),
    ]
    # two same-coloured objects that touch are one component: one object (a limitation, stated)
    touching = draw(
        [
            {"class": "circle", "color": "blue", "box": [2, 2, 12, 12]},
            {"class": "circle", "color": "blue", "box": [12, 2, 22, 12]},
        ]
    )
    assert sum(map(len, detect(touching).values())) == 1
    assert detect(np.zeros((32, 32, 3), np.float32)) == {}


def test_reward_rules_on_hand_cases():
    def scene(*objs):
        return draw([{"class": c, "color": k, "box": [x, y, x + 9, y + 9]} for c, k, x, y in objs])

    cases = [
        # (image, caption, GenEval's verdict, Flow-GRPO's partial score)
        (scene(("circle", "red", 2, 2), ("circle", "blue", 20, 2)), "a photo of three circles", 0, 2 / 3),
        (
            scene(*[("circle", "green", x, y) for x in (2, 20) for y in (2, 20)]),
            "a photo of three circles",
            0,  # four: the exclude clause
            2 / 3,
        ),
        (scene(("circle", "red", 2, 2)), "a photo of a circle and a square", 0, 1 / 2),
        (
            scene(("square", "blue", 20, 10), ("circle", "red", 2, 10)),
            "a photo of a circle left of a square",
            1,
            1,
        ),
        (
            scene(("square", "blue", 2, 10), ("circle", "red", 20, 10)),
            "a photo of a circle left of a square",
            0,
            3 / 4,  # terms 1, 1, 0 and Flow-GRPO's extra 1 after a failed position
        ),
        (scene(("triangle", "red", 2, 2)), "a photo of a blue triangle", 0, 1 / 2),
        (
            scene(("circle", "blue", 2, 2), ("square", "red", 20, 20)),
            "a photo of a red circle and a blue square",  # colours swapped
            0,
            2 / 4,
        ),
        (
            scene(("circle", "red", 2, 2), ("square", "blue", 20, 20)),
            "a photo of a red circle and a blue square",
            1,
            1,
        ),
    ]
    images = pixels(*(img for img, *_ in cases))
    prompts = [p for _, p, *_ in cases]
    metas = [row(p) for p in prompts]
    correct, _ = reward()(images, prompts, metas)
    assert correct.tolist() == [float(c) for *_, c, _ in cases]
    partial, _ = reward("flow_grpo")(images, prompts, metas)
    assert partial.tolist() == pytest.approx([s for *_, s in cases])


def test_bad_arguments_and_missing_metadata():
    with pytest.raises(UserError, match=r"reward.components.0.args.score: reward 'smallworld'"):
        reward("best")
    with pytest.raises(
        UserError, match="reward smallworld: prompt 'a photo of a circle' has no GenEval metadata"
    ):
        reward()(torch.zeros(1, 3, 32, 32), ["a photo of a circle"], [{}])


def test_the_detector_benchmark_finds_it_exact_on_drawings(tmp_path):
    data = run_benchmark_here("smallworld_detector.py", tmp_path, "--n", "6")
    assert set(data["drawn"]) == set(TAGS)
    assert all(r["own_caption"] == r["other_caption"] == r["objects"] == 1.0 for r in data["drawn"].values())
