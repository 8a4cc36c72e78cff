"""Per-sampler defaults (clip range by SDE kind, the advantage std's ddof) and the window range,
through the config as a user sets them; bad ranges give the one-line error."""

import numpy as np
import pytest
import torch

from digenrl.config.run import load_config
from tests.helpers import cli


@pytest.mark.parametrize("sde, want", [("flow_grpo", 1e-4), ("dance_grpo", 1e-4), ("cps", 1e-5)])
def test_clip_range_defaults_by_sde_kind_unless_set(sde, want):
    cfg = load_config(None, [f"sampling.sde={sde}"])  # the default demo leaves clip_range unset
    assert cfg.algorithm.clip_range == want
    assert (
        load_config(None, [f"sampling.sde={sde}", "algorithm.clip_range=3e-4"]).algorithm.clip_range == 3e-4
    )
    again = load_config(None, [f"sampling.sde={sde}", "algorithm.clip_range=null"])
    assert again.model_dump() == cfg.model_dump()  # the resolved value is what config.yaml records


def test_default_std_is_the_population_std():
    from digenrl.units.advantages import assign_advantages

    class Batch:
        def __init__(self, r):
            self.rewards, self.reward_parts, self.advantages = (
                torch.tensor(r),
                {"prompt_color": torch.tensor(r)},
                None,
            )

        def __len__(self):
            return len(self.rewards)

    r = np.array([0.1, 0.4, 0.35, 0.9, 0.2, 0.5, 0.6, 0.05])
    cfg = load_config(None, [])
    assert cfg.algorithm.std_ddof == 0
    b = Batch(r.tolist())
    assign_advantages([b], cfg)
    np.testing.assert_allclose(
        b.advantages.numpy(), (r - r.mean()) / (r.std() + 1e-4), rtol=1e-5
    )  # np.std: ddof 0
    b1 = Batch(r.tolist())
    assign_advantages([b1], load_config(None, ["algorithm.std_ddof=1"]))
    np.testing.assert_allclose(b1.advantages.numpy(), (r - r.mean()) / (r.std(ddof=1) + 1e-4), rtol=1e-5)


def test_window_steps_of_a_run_stay_inside_the_range():
    from digenrl.units.rollout import _timestep_selection

    cfg = load_config(
        None, ["algorithm.timesteps.mode=window", "algorithm.timesteps.window=2", "sampling.steps=10"]
    )
    assert cfg.algorithm.timesteps.window_range == (0.0, 0.5)
    starts = set()
    for it in range(40):
        mask, idx = _timestep_selection(cfg, it, 0, [0, 1], (0, 8))
        assert mask.sum() == 2 and mask.nonzero().max() <= 4 and (idx == mask.nonzero().squeeze(1)).all()
        starts.add(int(idx[0, 0]))
    assert starts == {0, 1, 2, 3}
    late = load_config(
        None,
        [
            "algorithm.timesteps.mode=window",
            "sampling.steps=10",
            "algorithm.timesteps.window_range=[0.5, 1.0]",
        ],
    )
    for it in range(20):
        mask, _ = _timestep_selection(late, it, 0, [0], (0, 8))
        assert mask.nonzero().min() >= 5 and mask.nonzero().max() <= 8  # never the last step


BAD_RANGES = {
    "reversed": (
        "algorithm.timesteps.window_range=[0.6, 0.2]",
        "algorithm.timesteps.window_range: must be [start, end] fractions of the steps",
    ),
    "above one": ("algorithm.timesteps.window_range=[0.0, 1.5]", "algorithm.timesteps.window_range: must be"),
    "too narrow for the window": (
        "algorithm.timesteps.window_range=[0.0, 0.1]",
        "algorithm.timesteps.window_range [0.0, 0.1] of sampling.steps (8) holds fewer",
    ),
}


@pytest.mark.parametrize("case", BAD_RANGES)
def test_bad_window_range_is_one_line(case, tmp_path, monkeypatch, capsys):
    setting, needle = BAD_RANGES[case]
    code, _, err = cli(
        monkeypatch,
        capsys,
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "algorithm.timesteps.mode=window",
        "--set",
        setting,
    )
    assert code == 2 and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()
