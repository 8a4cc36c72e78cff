"""benchmarks/learning.py: the reward-per-wall-second benchmark's smoke test (``--tiny``) and its
arithmetic. No timing or learning is asserted: the numbers belong to the benchmark."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.helpers import TINY_IMAGE, as_sets, run_benchmark_here

ROOT = Path(__file__).resolve().parents[1]


def bench():
    spec = importlib.util.spec_from_file_location("learning", ROOT / "benchmarks" / "learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gain_is_last_third_minus_first_third():
    b = bench()
    assert b.gain([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]) == pytest.approx(2.0)
    assert b.gain([0.5, 0.75]) == pytest.approx(0.25)  # fewer than 3: last minus first


def test_modes_are_engine_modes_own():
    b = bench()
    assert set(b.DEFAULT_MODES) <= set(b.engine_modes())
    assert "engine.max_staleness=1" in b.engine_modes()["full"]
    assert b.engine_modes()["local"] == ["placement.mode=local"]  # the single-process trainer


def test_unknown_algorithm_is_named_not_raised():
    b = bench()
    assert b.known_algorithm("flow_grpo", []) is None
    why = b.known_algorithm("no_such_algorithm", [])
    assert why and "algorithm" in why


def test_summary_mean_and_standard_error():
    b = bench()
    runs = [
        {"algorithm": "a", "mode": "m", "seed": s, **{k: v for k in b.METRICS}}
        for s, v in enumerate([1.0, 3.0])
    ]
    (row,) = b.summarize(runs)
    assert row["gain"] == 2.0 and row["gain_se"] == pytest.approx(1.0) and row["seeds"] == [0, 1]
    assert row["task"] == "colors"  # runs without a task are the demo's


def test_summary_of_the_held_out_scores_before_and_after():
    """--eval: each run's scores per reward and category, averaged over seeds (mean, standard error)."""
    b = bench()
    side = lambda m, t: {"mean": m, "by_tag": {"counting": t}}  # noqa: E731
    ev = lambda a, t: {"smallworld": {"before": side(0.3, 0.2), "after": side(a, t)}}  # noqa: E731
    runs = [
        {"algorithm": "a", "mode": "m", "seed": s, "eval": ev(a, t), **{k: 1.0 for k in b.METRICS}}
        for s, (a, t) in enumerate([(0.4, 0.5), (0.6, 0.7)])
    ]
    (row,) = b.summarize(runs)
    assert row["eval"]["smallworld/before"] == (0.3, 0.0)
    assert row["eval"]["smallworld/before/counting"][0] == 0.2
    assert row["eval"]["smallworld/after"] == (pytest.approx(0.5), pytest.approx(0.1))  # se: 0.1414 / sqrt 2
    assert row["eval"]["smallworld/after/counting"][0] == pytest.approx(0.6)
    assert "eval" not in b.summarize([{k: v for k, v in r.items() if k != "eval"} for r in runs])[0]


def test_ratio_and_its_standard_error_by_the_delta_method():
    b = bench()
    r, se = b.ratio_se(2.0, 0.2, 1.0, 0.1)  # relative errors 0.1 and 0.1: sqrt(0.02) x 2
    assert r == 2.0 and se == pytest.approx(2.0 * 0.02**0.5)


def test_best_against_flow_grpo_per_task_and_mode():
    b = bench()
    row = lambda t, a, g: {"task": t, "mode": "m", "algorithm": a, "gain_per_min": g, "gain_per_min_se": 0.1}  # noqa: E731
    summary = [row("colors", "flow_grpo", 1.0), row("colors", "awm", 3.0), row("shapes", "awm", 1.0)]
    (best,) = b.best_vs_flow_grpo(summary)  # shapes has no Flow-GRPO run: no ratio
    assert (best["task"], best["best"], best["ratio"]) == ("colors", "awm", 3.0)
    assert best["ratio_se"] == pytest.approx(3.0 * ((0.1 / 3) ** 2 + 0.1**2) ** 0.5)
    lost = [row("colors", "flow_grpo", -1.0), row("colors", "awm", 0.5)]
    assert b.best_vs_flow_grpo(lost)[0]["ratio"] is None  # no ratio to a loss


def test_tasks_are_rewards_the_config_knows():
    from digenrl.config.run import load_config

    b = bench()
    assert set(b.TASKS) == {"colors", "shapes", "smallworld"}
    cfg = load_config(None, b.TASKS["shapes"])
    assert [c.name for c in cfg.reward.components] == ["prompt_shape"]
    cfg = load_config(None, b.TASKS["smallworld"])  # configs/smallworld_flux.yaml's model, reward, prompts
    ref = load_config(b.ROOT / "configs" / "smallworld_flux.yaml")
    assert (Path(cfg.model.pretrained).resolve(), Path(cfg.prompts.file).resolve()) == (
        Path(ref.model.pretrained).resolve(),  # the config's paths: read from its folder
        Path(ref.prompts.file).resolve(),
    )
    assert cfg.reward.components == ref.reward.components and cfg.model.preset is None
    assert cfg.train.lr == ref.train.lr


@pytest.mark.slow
def test_tiny_run_writes_the_json_fields(tmp_path, ray_cluster):
    args = ["--tiny", "--modes", "local,full", "--algorithms", "flow_grpo,no_such_algorithm"]
    sets = as_sets(TINY_IMAGE)
    result = run_benchmark_here("learning.py", tmp_path, *args, "--tasks", "colors,shapes", *sets)
    assert "no_such_algorithm" in result["skipped"]
    assert [(r["task"], r["mode"], r["iterations"]) for r in result["runs"]] == [
        ("colors", "local", 2),
        ("colors", "full", 2),
        ("shapes", "local", 2),
        ("shapes", "full", 2),
    ]
    assert {(b["task"], b["mode"], b["best"]) for b in result["best_vs_flow_grpo"]} == {
        (t, m, "flow_grpo") for t in ("colors", "shapes") for m in ("local", "full")
    }
    for row in result["summary"]:
        assert row["algorithm"] == "flow_grpo" and row["seeds"] == [0]
        for key in ("gain", "gain_per_min", "gain_per_1k_samples", "samples_per_s"):
            assert isinstance(row[key], float) and key + "_se" in row
