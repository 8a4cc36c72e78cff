"""Weight-free rewards, video scoring per frame, and the weighted combination."""

import pytest
import torch

from digenrl.config import RewardConfig
from digenrl.errors import UserError
from digenrl.rewards import build_reward
from digenrl.rewards.basic import COLORS, JpegCompressibility, JpegIncompressibility, PromptColor


def test_jpeg_noise_is_less_compressible_than_flat():
    flat = torch.full((1, 3, 32, 32), 0.5)
    noise = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    imgs = torch.cat([flat, noise])
    inc = JpegIncompressibility()(imgs, ["x", "x"])
    assert inc[1] > 2 * inc[0] > 0
    assert torch.allclose(JpegCompressibility()(imgs, ["x", "x"]), -inc)


def test_prompt_color_is_one_for_the_named_colour():
    red = torch.tensor(COLORS["red"]).view(1, 3, 1, 1).expand(1, 3, 8, 8)
    r = PromptColor()(torch.cat([red, 1 - red]), ["a red car", "a red car"])
    assert r[0] == pytest.approx(1.0) and r[1] < 0.5
    meta = PromptColor()(red, ["a car"], [{"color": "red"}])
    assert meta[0] == pytest.approx(1.0)
    with pytest.raises(UserError, match="names no colour"):
        PromptColor()(red, ["a car"])


def test_video_scored_per_frame_and_averaged():
    red = torch.tensor(COLORS["red"]).view(1, 3, 1, 1, 1)
    video = torch.cat([red.expand(1, 3, 2, 8, 8), torch.zeros(1, 3, 2, 8, 8)], dim=2)  # 2 red + 2 black frames
    frames = video[0].permute(1, 0, 2, 3)
    per_frame = PromptColor()(frames, ["a red car"] * 4)
    assert PromptColor()(video, ["a red car"])[0] == pytest.approx(per_frame.mean().item())


def test_weighted_sum_and_parts():
    cfg = RewardConfig(components=[{"name": "prompt_color", "weight": 2.0}, {"name": "jpeg_compressibility", "weight": 0.5}])
    fn = build_reward(cfg)
    imgs = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    total, parts = fn(imgs, ["a blue bird", "a green boat"])
    assert set(parts) == {"prompt_color", "jpeg_compressibility"}
    assert torch.allclose(total, 2 * parts["prompt_color"] + 0.5 * parts["jpeg_compressibility"])


def test_unknown_reward_is_a_user_error():
    with pytest.raises(UserError, match="unknown reward 'pickscor'"):
        build_reward(RewardConfig(components=[{"name": "pickscor"}]))
