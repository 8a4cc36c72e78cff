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


@pytest.mark.slow
def test_tiny_run_writes_the_json_fields(tmp_path, ray_cluster):
    args = ["--tiny", "--modes", "colocated,full", "--algorithms", "flow_grpo,no_such_algorithm"]
    sets = as_sets(TINY_IMAGE)
    result = run_benchmark_here("learning.py", tmp_path, *args, *sets)
    assert "no_such_algorithm" in result["skipped"]
    assert [(r["mode"], r["iterations"]) for r in result["runs"]] == [("colocated", 2), ("full", 2)]
    for row in result["summary"]:
        assert row["algorithm"] == "flow_grpo" and row["seeds"] == [0]
        for key in ("gain", "gain_per_min", "gain_per_1k_samples", "samples_per_s"):
            assert isinstance(row[key], float) and key + "_se" in row
