"""Weight-free rewards, video scoring per frame, and the weighted combination."""

import pytest
import torch

from digenrl.config.train import RewardConfig
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
    video = torch.cat(
        [red.expand(1, 3, 2, 8, 8), torch.zeros(1, 3, 2, 8, 8)], dim=2
    )  # 2 red + 2 black frames
    frames = video[0].permute(1, 0, 2, 3)
    per_frame = PromptColor()(frames, ["a red car"] * 4)
    assert PromptColor()(video, ["a red car"])[0] == pytest.approx(per_frame.mean().item())


def test_weighted_sum_and_parts():
    cfg = RewardConfig(
        components=[{"name": "prompt_color", "weight": 2.0}, {"name": "jpeg_compressibility", "weight": 0.5}]
    )
    fn = build_reward(cfg)
    imgs = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    total, parts = fn(imgs, ["a blue bird", "a green boat"])
    assert set(parts) == {"prompt_color", "jpeg_compressibility"}
    assert torch.allclose(total, 2 * parts["prompt_color"] + 0.5 * parts["jpeg_compressibility"])


def test_unknown_reward_is_a_user_error():
    with pytest.raises(UserError, match="unknown reward 'pickscor'"):
        build_reward(RewardConfig(components=[{"name": "pickscor"}]))


def test_frame_stride_for_any_reward():
    red = torch.tensor(COLORS["red"]).view(1, 3, 1, 1, 1).expand(1, 3, 1, 8, 8)
    black = torch.zeros(1, 3, 1, 8, 8)
    video = torch.cat([red, black, red, black, red], dim=2)  # frames 0, 2, 4 red
    fn = build_reward(RewardConfig(components=[{"name": "prompt_color", "args": {"frame_stride": 2}}]))
    assert fn(video, ["a red car"])[0].item() == pytest.approx(1.0)
    assert build_reward(RewardConfig())(video, ["a red car"])[0].item() < 0.9  # every frame


def test_duplicate_reward_names_are_a_config_error():
    from digenrl.config.base import ConfigError
    from digenrl.config.run import validate_config

    with pytest.raises(ConfigError, match="reward.components: reward 'prompt_color' is listed twice"):
        validate_config({"reward": {"components": [{"name": "prompt_color"}, {"name": "prompt_color"}]}})


# --------------------------------------------------------------- bad rewards, NaN policy, dry run


@pytest.fixture
def fake_rewards():
    """Test-only rewards: a constant per prompt ('good' = 1, 'bad' = NaN), a wrong shape, a crash, inf."""
    from digenrl.rewards.base import REWARDS, Reward, register

    @register("_by_prompt")
    class ByPrompt(Reward):
        def score(self, images, prompts, metadata):
            return torch.tensor([float("nan") if "bad" in p else float(len(p)) for p in prompts])

    @register("_all_nan")
    class AllNan(Reward):
        def score(self, images, prompts, metadata):
            return torch.full((len(prompts),), float("nan"))

    @register("_wrong_shape")
    class WrongShape(Reward):
        def score(self, images, prompts, metadata):
            return torch.zeros(len(prompts), 2)

    @register("_crash")
    class Crash(Reward):
        def score(self, images, prompts, metadata):
            raise RuntimeError("size mismatch in the head")

    @register("_inf")
    class Inf(Reward):
        def score(self, images, prompts, metadata):
            return torch.full((len(prompts),), float("inf"))

    yield
    for name in ("_by_prompt", "_all_nan", "_wrong_shape", "_crash", "_inf"):
        REWARDS.pop(name)


def _reward(*names, nan_policy="fail"):
    return build_reward(RewardConfig(components=[{"name": n} for n in names], nan_policy=nan_policy))


def test_nan_fails_or_passes_on_by_policy(fake_rewards):
    imgs = torch.rand(3, 3, 8, 8)
    prompts = ["a good red", "a bad red", "a good blue"]
    with pytest.raises(
        UserError, match=r"reward '_by_prompt' returned NaN for 1 of 3 samples .*nan_policy=drop"
    ):
        _reward("prompt_color", "_by_prompt")(imgs, prompts)
    total, parts = _reward("prompt_color", "_by_prompt", nan_policy="drop")(imgs, prompts)
    assert torch.isnan(total).tolist() == [False, True, False]
    assert not torch.isnan(parts["prompt_color"]).any()
    with pytest.raises(UserError, match=r"'_all_nan' returned NaN for 3 of 3"):  # nothing left to train on
        _reward("_all_nan", nan_policy="drop")(imgs, prompts)
    with pytest.raises(UserError, match=r"reward '_wrong_shape' returned shape \(3, 2\), expected \(3,\)"):
        _reward("_wrong_shape")(imgs, prompts)
    with pytest.raises(UserError, match=r"reward '_inf' returned inf"):
        _reward("_inf", nan_policy="drop")(imgs, prompts)


def test_dry_run_names_the_broken_reward(fake_rewards):
    shape = (3, 16, 16)
    assert set(_reward("prompt_color", "jpeg_compressibility").check(["a red car"], shape)) == {
        "prompt_color",
        "jpeg_compressibility",
    }
    _reward("prompt_color").check(["a red car"], (3, 4, 16, 16))  # a video shape
    with pytest.raises(
        UserError, match=r"components\.1: reward '_crash' failed in its dry run .*RuntimeError: size mismatch"
    ):
        _reward("prompt_color", "_crash").check(["a red car"], shape)
    with pytest.raises(UserError, match=r"reward '_wrong_shape' in its dry run .* returned shape \(2, 2\)"):
        _reward("_wrong_shape").check(["a red car"], shape)
    with pytest.raises(UserError, match=r"reward '_by_prompt' in its dry run .* returned NaN for 2 of 2"):
        _reward("_by_prompt", nan_policy="drop").check(["a bad one"], shape)
    with pytest.raises(UserError, match=r"reward '_by_prompt' in its dry run .* returned NaN for 1 of 2"):
        _reward("_by_prompt").check(["a good one", "a bad one"], shape)
    _reward("_by_prompt", nan_policy="drop").check(["a good one", "a bad one"], shape)  # some scored: fine
    with pytest.raises(
        UserError, match=r"components\.0: reward 'prompt_color' failed in its dry run .*names no colour"
    ):
        _reward("prompt_color").check(["a car"], shape)


def test_reward_metrics_leave_nan_out():
    from digenrl.rewards import reward_metrics

    row = reward_metrics(
        torch.tensor([1.0, float("nan"), 3.0]),
        {"a": torch.tensor([1.0, float("nan"), 3.0]), "b": torch.tensor([0.0, 2.0, 4.0])},
    )
    assert row["reward_nan"] == 1 and row["reward_mean"] == 2.0 and row["reward_std"] == pytest.approx(2**0.5)
    assert row["reward/a"] == 2.0 and row["reward/b"] == 2.0


# ------------------------------------------------------------------------ advantages: combine, NaN


class _Batch:  # what assign_advantages needs of a Samples (or the engine's RewardBatch)
    def __init__(self, parts, weights):
        self.reward_parts = {k: torch.tensor(v) for k, v in parts.items()}
        self.rewards = sum(weights[k] * self.reward_parts[k] for k in parts)
        self.advantages = None

    def __len__(self):
        return len(self.rewards)


def _run_cfg(combine, group_size, weights, std="per_prompt", nan_policy="fail", adv_clip=5.0, std_ddof=1):
    """The closed forms below use the sample std (ddof 1); the default ddof 0 is tested in test_grpo.py."""
    from digenrl.config.run import RunConfig

    return RunConfig(
        algorithm={"group_size": group_size, "std": std, "adv_clip": adv_clip, "std_ddof": std_ddof},
        reward={
            "combine": combine,
            "nan_policy": nan_policy,
            "components": [{"name": n, "weight": w} for n, w in weights.items()],
        },
    )


def test_weighted_sum_vs_per_reward_advantage_closed_form():
    from digenrl.units.advantages import assign_advantages

    w = {"a": 1.0, "b": 0.5}
    parts = {"a": [1.0, 2.0, 3.0], "b": [0.0, 0.0, 6.0]}  # one group of 3
    eps = 1e-4
    # weighted sum: total = [1, 2, 6], mean 3, std sqrt(7)
    b = _Batch(parts, w)
    assign_advantages([b], _run_cfg("weighted_sum", 3, w))
    assert torch.allclose(b.advantages, torch.tensor([-2.0, -1.0, 3.0]) / (7**0.5 + eps))
    # per reward: a -> [-1, 0, 1] / (1 + eps); b -> [-2, -2, 4] / (sqrt(12) + eps); then 1 * a + 0.5 * b
    b = _Batch(parts, w)
    assign_advantages([b], _run_cfg("per_reward_advantage", 3, w))
    want = torch.tensor([-1.0, 0.0, 1.0]) / (1 + eps) + 0.5 * torch.tensor([-2.0, -2.0, 4.0]) / (
        12**0.5 + eps
    )
    assert torch.allclose(b.advantages, want)
    # the clip applies to the weighted sum of advantages
    b = _Batch(parts, w)
    assign_advantages([b], _run_cfg("per_reward_advantage", 3, w, adv_clip=1.2))
    assert torch.allclose(b.advantages, want.clamp(-1.2, 1.2))
    # global std: per component over both batches (one group each)
    b1, b2 = _Batch(parts, w), _Batch({"a": [3.0, 3.0, 6.0], "b": [1.0, 1.0, 1.0]}, w)
    assign_advantages([b1, b2], _run_cfg("per_reward_advantage", 3, w, std="global"))
    sa, sb = torch.tensor([1.0, 2, 3, 3, 3, 6]).std(), torch.tensor([0.0, 0, 6, 1, 1, 1]).std()
    assert torch.allclose(
        b1.advantages,
        torch.tensor([-1.0, 0, 1]) / (sa + eps) + 0.5 * torch.tensor([-2.0, -2, 4]) / (sb + eps),
    )
    assert torch.allclose(b2.advantages, torch.tensor([-1.0, -1, 2]) / (sa + eps))  # b is flat: no signal


def test_dropped_samples_get_zero_advantage_and_leave_the_group_stats():
    from digenrl.algorithms.grpo import group_advantages
    from digenrl.units.advantages import assign_advantages

    nan, eps = float("nan"), 1e-4
    a = group_advantages(torch.tensor([1.0, nan, 3.0, 5.0, 7.0, nan, nan, nan]), 4, ddof=1)
    assert torch.allclose(
        a[:4], torch.tensor([-2.0, 0.0, 0.0, 2.0]) / (2 + eps)
    )  # mean 3, std 2 of [1, 3, 5]
    assert torch.all(a[4:] == 0)  # one scored sample: no signal
    g = group_advantages(torch.tensor([0.0, nan, 2.0, 4.0, 6.0, nan]), 3, std="global", ddof=1)
    s = torch.tensor([0.0, 2.0, 4.0, 6.0]).std()
    assert torch.allclose(g, torch.tensor([-1.0, 0.0, 1.0, -1.0, 1.0, 0.0]) / (s + eps))
    # per-reward advantages: a NaN in one component drops the sample from every component
    w = {"a": 1.0, "b": 1.0}
    b = _Batch({"a": [1.0, 2.0, 3.0, 9.0], "b": [0.0, 1.0, 2.0, nan]}, w)
    assign_advantages([b], _run_cfg("per_reward_advantage", 4, w, nan_policy="drop"))
    want = 2 * torch.tensor([-1.0, 0.0, 1.0]) / (1 + eps)
    assert torch.allclose(b.advantages, torch.cat([want, torch.zeros(1)]))
    b = _Batch({"a": [1.0, 2.0, 3.0, 9.0], "b": [0.0, 1.0, 2.0, nan]}, w)
    assign_advantages([b], _run_cfg("weighted_sum", 4, w, nan_policy="drop"))
    assert torch.allclose(
        b.advantages, torch.cat([torch.tensor([-2.0, 0.0, 2.0]) / (2 + eps), torch.zeros(1)])
    )


def test_every_registered_reward_is_documented_in_configs_md():
    from pathlib import Path

    from digenrl.rewards.base import REWARDS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configs.md").read_text()
    rows = {line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| `")}
    documented = {name.strip("` ") for row in rows for name in row.split("/")}
    assert sorted(set(REWARDS) - documented) == []


def test_per_component_advantage_metrics_by_hand():
    from digenrl.units.advantages import advantage_metrics

    w, eps = {"a": 1.0, "b": 0.5}, 1e-4
    # two groups of 3: b tells samples apart in the first only
    b = _Batch({"a": [1.0, 2.0, 3.0, 5.0, 6.0, 7.0], "b": [0.0, 0.0, 6.0, 2.0, 2.0, 2.0]}, w)
    for combine in ("weighted_sum", "per_reward_advantage"):  # the same statistics either way
        row = advantage_metrics([b], _run_cfg(combine, 3, w))
        # |A_a| = [1, 0, 1] / (1 + eps) in both groups; |A_b| = [2, 2, 4] / (sqrt(12) + eps), then 0
        assert row["adv/a"] == pytest.approx((4 / 6) / (1 + eps))
        assert row["adv/b"] == pytest.approx(0.5 * (8 / 6) / (12**0.5 + eps))
        assert row["adv_groups/a"] == 1.0 and row["adv_groups/b"] == 0.5
    # a dropped sample (NaN total) leaves both components' statistics
    nan = float("nan")
    b = _Batch({"a": [1.0, 2.0, 3.0, 9.0], "b": [0.0, 0.0, 0.0, nan]}, w)
    row = advantage_metrics([b], _run_cfg("per_reward_advantage", 4, w, nan_policy="drop"))
    assert row["adv/a"] == pytest.approx((2 / 3) / (1 + eps))  # A_a of [1, 2, 3] over 3 scored samples
    assert row["adv/b"] == 0.0 and row["adv_groups/b"] == 0.0


@pytest.mark.slow
def test_the_local_trainer_logs_per_component_advantage_statistics(tmp_path):
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer
    from tests.helpers import QUIET, TINY

    two = "reward.components=[{name: prompt_color}, {name: jpeg_compressibility, weight: 0.01}]"
    cfg = load_config(None, [*TINY, *QUIET, "train.iterations=1", "reward.combine=per_reward_advantage", two])
    (row,) = LocalTrainer(cfg).run(tmp_path).metrics
    assert row["adv_groups/prompt_color"] == 1.0  # random images: every group's colours differ
    assert row["adv/prompt_color"] > 0 and row["adv/jpeg_compressibility"] > 0
