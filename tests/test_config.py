"""RunConfig: defaults, files, overrides, and one-line errors naming the dotted path (exit code 2)."""

from pathlib import Path

import pytest

from digenrl.config.base import ConfigError
from digenrl.config.run import RunConfig, load_config
from tests.helpers import FULL_MODE, FULL_MODE_SETS, cli

CONFIGS = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))


def test_embedded_default_is_the_tiny_flux_demo():
    cfg = load_config()
    assert cfg.model.adapter == "flux" and cfg.model.preset == "tiny" and cfg.model.lora is not None
    assert cfg.algorithm.name == "flow_grpo"
    # colocated, on-policy, no overlap knobs: what learns the most reward per minute on 1 + 1 CPU devices
    e = cfg.engine
    assert cfg.placement.mode == "colocated"
    assert (e.gap, e.tag, e.tsp_degree, e.max_staleness) == (False, None, 1, 0)  # tag unset: colocated, off


def test_the_full_mode_demo_is_the_default_with_the_full_mode_knobs():
    """configs/flux_tiny_disaggregated.yaml is the default demo on the engine's full mode (GAP + TSP 2 +
    TAG + one-step async), nothing else changed: tests.helpers.FULL_MODE is that file's knobs."""
    full = load_config(Path("configs/flux_tiny_disaggregated.yaml"))
    assert full == load_config(None, FULL_MODE)
    e = full.engine
    assert full.placement.mode == "disaggregated"
    assert (e.gap, e.tag, e.tsp_degree, e.max_staleness, e.weight_sync) == (True, True, 2, 1, "auto")
    assert full.train == load_config().train  # the same lr and iterations as the default demo


def test_one_source_of_truth_for_the_defaults(tmp_path):
    """RunConfig() is what `digenrl train` runs with no arguments, configs/flux_tiny.yaml writes
    exactly that out, and an empty or null file means the same defaults."""
    default = RunConfig()
    assert load_config(None, []) == default
    assert load_config(Path("configs/flux_tiny.yaml")) == default
    for text in ("", "null\n", "# only a comment\n"):
        f = tmp_path / "c.yaml"
        f.write_text(text)
        assert load_config(f) == default
    partial = tmp_path / "partial.yaml"
    partial.write_text("train:\n  iterations: 7\n")
    layered = load_config(partial)  # a partial file layers on the same defaults
    assert layered.train.iterations == 7
    assert layered.model_copy(update={"train": default.train}) == default


def test_algorithm_name_selects_its_defaults():
    flow, dance = load_config(None, []), load_config(None, ["algorithm.name=dance_grpo"])
    assert flow.sampling.sde == "flow_grpo" and flow.algorithm.timesteps.mode == "fraction"
    assert flow.algorithm.timesteps.fraction == 0.99
    assert dance.sampling.sde == "dance_grpo" and dance.algorithm.timesteps.mode == "random"
    assert dance.algorithm.timesteps.fraction == 0.6
    # what a config sets explicitly wins over what the name selects
    mixed = load_config(
        None, ["algorithm.name=dance_grpo", "sampling.sde=flow_grpo", "algorithm.timesteps.mode=fraction"]
    )
    assert mixed.sampling.sde == "flow_grpo" and mixed.algorithm.timesteps.fraction == 0.99
    assert RunConfig.model_validate(dance.model_dump()) == dance  # a dumped config reads back the same


def test_duplicate_yaml_key_is_an_error(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert str(exc.value) == f"{f}: key 'lr' appears twice in one mapping (line 3)"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    assert isinstance(load_config(path), RunConfig)


def test_overrides_types_and_lists():
    cfg = load_config(
        None,
        [
            "train.lr=0.5",
            "model.lora.targets=[to_q, to_k]",
            "reward.components.0.weight=2",
            "model.pretrained=/some/dir",
        ],
    )
    assert cfg.train.lr == 0.5 and cfg.model.lora.targets == ["to_q", "to_k"]
    assert cfg.reward.components[0].weight == 2.0
    assert cfg.model.preset is None  # a pretrained path replaces the default preset


@pytest.mark.parametrize(
    "override, path, reason",
    [
        ("train.iterations=-1", "train.iterations", "greater than 0"),
        ("train.itrations=3", "train.itrations", "unknown key"),
        ("algorithm.group_size=1", "algorithm.group_size", "greater than or equal to 2"),
        ("engine.unit_groups=3", "engine.unit_groups", "divide"),
        ("engine.max_staleness=2", "engine.max_staleness", ""),
        ("model.adapter=sdxl", "model.adapter", "available: flux"),
        ("sampling.sde=ddim", "sampling.sde", ""),
        ("placement.rollout_pool=nope", "placement.rollout_pool", ""),
        ("train.lr=inf", "train.lr", "finite"),
        ("train.lr=.nan", "train.lr", "finite"),
        ("sampling.guidance=-.inf", "sampling.guidance", "finite"),
        ("sampling.steps=100000", "sampling.steps", "less than or equal to 1000"),
        ("model.height=100000", "model.height", "less than or equal to 8192"),
        ("output.name=../../../x", "output.name", "plain name"),
        ("output.name=a/b", "output.name", "plain name"),
    ],
)
def test_invalid_values_name_the_dotted_path(override, path, reason):
    extra = ["placement.mode=disaggregated"] if "pool" in override else []
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override, *extra])
    msg = str(exc.value)
    assert path in msg and reason in msg and "\n" not in msg


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["config", "validate", "--set", "train.iterations=-1"], "train.iterations"),
        (["config", "validate", "--set", "nosuch.key=1"], "nosuch: unknown key"),
        (
            ["config", "show", "--set", "model.adapter=sdxl"],
            "available: flux, flux2, flux_kontext, hunyuan_video, hunyuan_video15, hunyuan_video15_i2v, "
            "qwen_image, qwen_image_edit, sd3, wan, wan22, z_image",
        ),
        (["config", "validate", "--config", "MISSING.yaml"], "MISSING.yaml: config file not found"),
        (
            ["train", "--set", "prompts.file=/nonexistent/prompts.txt", "--run-dir", "{tmp}/run"],
            "prompts.file",
        ),
        (["train", "--set", "model.height=30", "--run-dir", "{tmp}/run"], "model.height"),
        (
            ["train", "-c", "configs/wan_tiny.yaml", "--set", "model.frames=6", "--run-dir", "{tmp}/run"],
            "model.frames",
        ),
        (["train", "--set", "model.pretrained={tmp}/no-such-ckpt", "--run-dir", "{tmp}/run"], "no-such-ckpt"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(monkeypatch, capsys, tmp_path, argv, needle):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] == "train" and "-c" not in argv:  # on the engine's full mode, as before the default changed
        argv = ["train", *FULL_MODE_SETS, *argv[1:]]
    code, _, err = cli(monkeypatch, capsys, *argv)
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_cli_malformed_yaml(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [flux\n")
    code, _, err = cli(monkeypatch, capsys, "config", "validate", "-c", str(bad))
    assert code == 2 and "malformed YAML at line" in err and str(bad) in err


def test_cli_show_round_trips(monkeypatch, capsys, tmp_path):
    code, out, _ = cli(monkeypatch, capsys, "config", "show", "--set", "train.seed=7")
    assert code == 0
    dumped = tmp_path / "c.yaml"
    dumped.write_text(out)
    assert load_config(dumped) == load_config(None, ["train.seed=7"])


def test_non_finite_gradient_names_the_likely_field(tiny_cfg):
    """An overflowing gradient is reported as what it is (naming train.lr), and the step is refused:
    the weights stay as they were, so nothing downstream (the reward) sees NaN."""
    import torch

    from digenrl.errors import UserError
    from digenrl.policy.model import Policy

    cfg = tiny_cfg("train.lr=5")
    policy = Policy(cfg, device="cpu")
    before = [p.detach().clone() for p in policy.params]
    for p in policy.params:
        p.grad = torch.full_like(p, float("inf"))
    with pytest.raises(UserError) as exc:
        policy.optimizer_step()
    assert str(exc.value).startswith("train.lr: the loss or its gradient is not finite")
    assert "train.lr (5) too large" in str(exc.value)
    assert all(torch.equal(a, b) for a, b in zip(before, policy.params)) and policy.version == 0


def test_nan_samples_are_not_blamed_on_the_reward():
    import torch

    from digenrl.config.train import RewardConfig
    from digenrl.errors import UserError
    from digenrl.rewards import build_reward

    reward = build_reward(RewardConfig())
    pixels = torch.full((2, 3, 8, 8), float("nan"))
    with pytest.raises(UserError, match=r"^train.lr: the generated samples hold NaN"):
        reward(pixels, ["a red apple", "a blue car"])
