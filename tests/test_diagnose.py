"""Why the reward is not increasing (issue 56): the per-iteration group statistics, by hand, and the one
line a flat run ends with, for each cause it names."""

import math
import sys
from types import SimpleNamespace

import pytest
import torch

from digenrl.run.diagnose import diagnosis, group_metrics, is_flat
from tests.helpers import QUIET, TINY


def test_group_metrics_by_hand():
    """Two groups of 4: one all equal (no signal), one 0, 1, 0, 1 (sample std sqrt(1/3)); a NaN score
    (nan_policy drop) is left out of its group."""
    unit = SimpleNamespace(rewards=torch.tensor([0.5, 0.5, 0.5, 0.5, 0.0, 1.0, 0.0, 1.0]), group_ids=[3, 7])
    row = group_metrics([unit])
    assert row["groups_zero_std"] == 0.5
    assert row["reward_std_in_group"] == pytest.approx(math.sqrt(1 / 3) / 2)
    nan = SimpleNamespace(rewards=torch.tensor([0.2, float("nan"), 0.2, 0.2]), group_ids=[0])
    assert group_metrics([nan])["groups_zero_std"] == 1.0


def rows(n=12, rise=0.0, noise=0.01, **extra):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        r = {"reward_mean": 0.5 + rise * i + noise * torch.randn(1, generator=g).item(), **extra}
        out.append(r)
    return out


def test_a_rising_reward_is_not_flat_and_gets_no_line():
    assert not is_flat(rows(rise=0.02)) and diagnosis(rows(rise=0.02)) is None
    assert is_flat(rows()) and not is_flat(rows(n=5))  # too few iterations to tell: no line


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"groups_zero_std": 0.8, "clip_frac": 0.5}, "in 80% of the groups every sample got the same reward"),
        ({"groups_zero_std": 0.1, "clip_frac": 0.5}, "50% of the trained terms were clipped"),
        ({"groups_zero_std": 0.0, "clip_frac": 0.0, "ratio_min": 1.0, "ratio_max": 1.0}, "raise train.lr"),
    ],
)
def test_a_flat_run_names_the_metric_that_points_at_the_cause(extra, words):
    assert words in diagnosis(rows(**extra))


def test_components_pulling_against_each_other_are_named():
    flat = rows(groups_zero_std=0.0, clip_frac=0.05)
    for i, r in enumerate(flat):
        r["reward/a"], r["reward/b"] = 0.1 * i, -0.1 * i
    assert "reward/a rose (+0.8000) while reward/b fell (-0.8000)" in diagnosis(flat)


@pytest.mark.slow
def test_a_run_that_cannot_learn_ends_with_the_line_and_logs_the_metrics(tmp_path, monkeypatch, capsys):
    """train.lr 1e-12 on the local trainer: the policy never moves (ratio 1, nothing clipped); the summary
    says so, and every row carries the group statistics."""
    from digenrl.cli.app import main
    from digenrl.run.rundir import read_metrics

    sets = [*TINY, *QUIET, "placement.mode=local", "train.iterations=6", "train.lr=1e-12"]
    argv = [
        "digenrl",
        "train",
        "-q",
        "--run-dir",
        str(tmp_path / "run"),
        *(a for s in sets for a in ("--set", s)),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "the reward did not increase" in out and "the policy hardly moves" in out and "raise train.lr" in out
    )
    metrics = read_metrics(tmp_path / "run")
    assert all(0 <= r["groups_zero_std"] <= 1 and r["reward_std_in_group"] >= 0 for r in metrics)
