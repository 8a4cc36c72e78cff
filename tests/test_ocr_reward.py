"""The ``ocr`` reward on the real PP-OCRv4 models (the ``ocr`` extra): rendered words read and score 1,
noise scores 0, a near miss scores as Flow-GRPO's rule says; the rule itself against hand counts."""

import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from digenrl.config.train import RewardConfig
from digenrl.errors import UserError
from digenrl.rewards import build_reward
from digenrl.rewards.ocr import edit_distance, ocr_score, ocr_target

pytest.importorskip("rapidocr_onnxruntime", reason="the ocr extra (./dev.sh installs it)")

FONTS = "/usr/share/fonts/truetype/dejavu/"


def _render(text: str, side: int, font: str, frac: float) -> torch.Tensor:
    """Black ``text`` on white, centred, its size ``frac`` of the image side: (3,side,side) in [0,1]."""
    img = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(img)
    f = ImageFont.truetype(FONTS + font, max(8, int(side * frac)))
    left, top, right, bottom = draw.textbbox((0, 0), text, font=f)
    draw.text(((side - right + left) / 2 - left, (side - bottom + top) / 2 - top), text, fill="black", font=f)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    return build_reward(RewardConfig(components=[{"name": "ocr"}]))


def test_edit_distance_and_score_by_hand():
    assert edit_distance("kitten", "sitting") == 3  # k->s, e->i, +g
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "abc") == 0
    assert edit_distance("flaw", "lawn") == 2
    assert ocr_score("Hello World", "hello world") == 1.0  # case and spaces do not count
    assert ocr_score("a sign: OPEN now", "open") == 1.0  # the target inside the reading
    assert ocr_score("Rewarcl", "Reward") == pytest.approx(1 - 2 / 6)  # d -> c, +l
    assert ocr_score("", "seven") == 0.0
    assert ocr_score("x" * 40, "abc") == 0.0  # the distance is capped at the target's length
    assert ocr_target('a sign that says "Hello World" at dusk', {}) == "Hello World"
    assert ocr_target("no quotes", {"text": "Hi"}) == "Hi"
    with pytest.raises(UserError, match="quotes no text"):
        ocr_target("a sign with no quotes", {})


@pytest.mark.slow  # ~2.5 s: four images up to 512 px (test_noise_and_a_near_miss reads two in the fast loop)
def test_rendered_words_read_and_score_one(ocr):
    cases = [  # (text, side, font, size as a fraction of the side)
        ("Hello", 64, "DejaVuSans.ttf", 0.22),
        ("Open Late", 256, "DejaVuSerif.ttf", 0.12),
        ("Fresh Bread Daily", 256, "DejaVuSans-Bold.ttf", 0.08),
        ("DigenRL reads text", 512, "DejaVuSansMono.ttf", 0.06),
    ]
    images = torch.stack([_render(t, s, f, k) for t, s, f, k in cases[:1]])
    total, parts = ocr(images, [f'a sign that says "{cases[0][0]}"'], None)
    assert parts["ocr"].tolist() == [1.0]
    for text, side, font, frac in cases[1:]:
        img = _render(text, side, font, frac)[None]
        assert ocr(img, [f'a poster reading "{text}"'])[1]["ocr"].tolist() == [1.0], text


def test_noise_and_a_near_miss(ocr):
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(2, 3, 256, 256, generator=g)
    assert ocr(noise, ['"Bakery"', '"Hello World"'])[1]["ocr"].tolist() == [0.0, 0.0]
    # the image spells "Garden", one letter of seven short of the prompt's "Gardens"
    img = _render("Garden", 256, "DejaVuSans.ttf", 0.15)[None]
    assert ocr(img, ['a shop sign that says "Gardens"'])[1]["ocr"].item() == pytest.approx(6 / 7)
    # one wrong letter of seven: the image spells "Planets", the prompt "Plankts"
    img = _render("Planets", 256, "DejaVuSans.ttf", 0.15)[None]
    assert ocr(img, ['"Plankts"'])[1]["ocr"].item() == pytest.approx(6 / 7)


def test_missing_extra_and_bad_args_are_one_line(monkeypatch):
    with pytest.raises(UserError, match=r"reward\.components\.0\.args\.threads: .*positive integer"):
        build_reward(RewardConfig(components=[{"name": "ocr", "args": {"threads": 0}}]))
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # as if not installed
    with pytest.raises(
        UserError, match=r"^reward\.components\.0: reward 'ocr' needs the optional extra 'ocr'"
    ):
        build_reward(RewardConfig(components=[{"name": "ocr"}]))
