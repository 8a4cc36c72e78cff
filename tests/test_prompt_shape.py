"""The second learning task's reward, ``prompt_shape``: the target picture scores 1, an image with the
right mean colour but no shape scores less, the shapes are what their names say (areas by hand), and
the object word picks the shape."""

from __future__ import annotations

import math

import pytest
import torch

from digenrl.config.train import RewardConfig
from digenrl.rewards import build_reward
from digenrl.rewards.structure import SHAPES, shape_mask, shape_of, target_image


def test_shape_areas_match_their_geometry():
    n = 400  # fine grid: the pixel fraction approaches the area / 4 of [-1, 1]^2
    area = {s: shape_mask(s, n, n).float().mean().item() for s in SHAPES}
    assert area["disc"] == pytest.approx(math.pi * 0.6**2 / 4, abs=2e-3)
    assert area["square"] == pytest.approx(0.25, abs=2e-3)
    assert area["ring"] == pytest.approx(math.pi * (0.8**2 - 0.4**2) / 4, abs=2e-3)
    assert area["hbar"] == pytest.approx(0.3, abs=2e-3) and area["vbar"] == pytest.approx(0.3, abs=2e-3)
    assert area["cross"] == pytest.approx(0.2 + 0.2 - 0.04, abs=2e-3)


def test_target_scores_one_and_the_mean_colour_alone_does_not():
    reward = build_reward(RewardConfig(components=[{"name": "prompt_shape"}]))
    prompt = "a red flower"
    assert shape_of(prompt, {}) == "square"  # sum of the codes of "flower" mod 6
    target = target_image("red", "square", 16, 16)
    flat = target.mean(dim=(1, 2), keepdim=True).expand(3, 16, 16)  # the right mean colour, no shape
    other = target_image("red", "hbar", 16, 16)  # the right colour, the wrong shape
    total, _ = reward(torch.stack([target, flat, other]), [prompt] * 3, [{}] * 3)
    assert total[0].item() == pytest.approx(1.0, abs=1e-6)
    assert total[1] < total[0] - 0.1 and total[2] < total[0] - 0.1
    # by hand for the flat image: the same distance d_in inside the square (1/4 of the pixels), d_out outside
    mean = target[:, 8, 8] * 0.25 + 0.5 * 0.75  # (8, 8) lies in the square, (0, 0) on the ground
    d_in = (mean - target[:, 8, 8]).norm().item() / 3**0.5
    d_out = (mean - torch.full((3,), 0.5)).norm().item() / 3**0.5
    assert total[1].item() == pytest.approx(1 - (0.25 * d_in + 0.75 * d_out), abs=1e-5)


def test_metadata_overrides_and_the_word_picks_the_shape():
    assert shape_of("a blue car", {"shape": "disc"}) == "disc"
    assert {shape_of(f"a blue {o}", {}) for o in ("apple", "car", "bird", "flower")} == {
        "ring",
        "vbar",
        "hbar",
        "square",
    }
