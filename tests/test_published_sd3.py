"""The SD3.5 published figures checked out of sample (digenrl/planner/published_sd3.py): the cited numbers
as published, and the predictions within the bands docs/scaling/sd35_rows.md reports (efficiencies fitted
on Qwen-Image, nothing refitted)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace
from pathlib import Path

import pytest

from digenrl.planner import peer_verl_omni as verl
from digenrl.planner.costmodel import CostModel
from digenrl.planner.published import NOT_CHECKED, OUT_OF_SAMPLE
from digenrl.planner.published_sd3 import MM_GRPO, VERL_OMNI_SD35_GENERATION

ROOT = Path(__file__).resolve().parents[1]

#: MM-GRPO's table (README.md:95-97 @d91797e): name fragment -> (prompts, images/GPU/s, pool split,
#: the predicted s/step docs/scaling/sd35_rows.md reports)
MM_TABLE = {
    "1 actor + 2 rollout": (8, 1.07, "R 2xH800 / T 1xH800", 6.47),
    "2 actor + 1 rollout": (16, 1.25, "R 1xH800 / T 2xH800", 10.55),
    "hybrid engine": (24, 1.42, "3xH800", 11.83),
}
#: veRL-Omni docs/start/rollout_batching.md:132: max_num_seqs -> (published s, predicted s reported)
SD35_GENERATION = {1: (25.4, 3.61), 256: (22.3, 1.36)}
#: how far a prediction may move from the reported one before the test calls it a regression
BAND = 0.25


@pytest.fixture(scope="module")
def calibration():
    spec = importlib.util.spec_from_file_location(
        "peer_calibration", ROOT / "benchmarks" / "peer_calibration.py"
    )
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    return cal, cal.fit()


def _row(fragment: str):
    (setup,) = [s for s in MM_GRPO if fragment in s.name]
    return setup


def test_the_mm_grpo_rows_are_the_published_table():
    """Three rows, in OUT_OF_SAMPLE, each with the table's throughput and the s/step it implies
    (perf/throughput = images / (step s x 3 GPUs), metric_utils.py:205)."""
    assert len(MM_GRPO) == 3 and all(s in OUT_OF_SAMPLE for s in MM_GRPO)
    for fragment, (prompts, throughput, _, _) in MM_TABLE.items():
        s = _row(fragment)
        assert s.published_images_per_gpu_s == throughput and s.cluster == "3xH800"
        assert s.published_step_s == pytest.approx(prompts * 8 / (throughput * 3), abs=0.01)
        w = s.workload()
        assert (w.prompts, w.group_size, w.steps, w.trained_steps, w.passes) == (prompts, 8, 10, 3, 1)
        assert w.lora and not w.kl and "README.md:93-97" in s.source and "d91797e" in s.source
    assert _row("hybrid").peer == "verl_omni_colocated"
    assert {_row("1 actor").peer, _row("2 actor").peer} == {"verl_omni_separate_async"}


def test_the_sd35_generation_figure_is_the_published_one():
    g = VERL_OMNI_SD35_GENERATION
    assert g.points == {b: p for b, (p, _) in SD35_GENERATION.items()} and g.gpus == 2
    assert "rollout_batching.md:132" in g.source
    w = g.workload()
    assert (w.samples, w.steps, w.passes, w.shape.tokens.x) == (64, 10, 1, (384 // 16) ** 2)


def test_no_sd35_figure_is_left_waiting_for_the_family():
    assert not any("needs the SD3.5 family" in x for x in NOT_CHECKED)


def test_mm_grpo_predictions_stay_in_the_reported_band(calibration):
    """The peer model on the published split, with the fitted efficiencies: the step each row reports."""
    cal, f = calibration
    for fragment, (_, _, where, reported) in MM_TABLE.items():
        o = cal.predict(_row(fragment), f)
        assert math.isfinite(o["predicted_step_s"]) and o["predicted_step_s"] > 0
        assert abs(o["predicted_step_s"] / reported - 1) <= BAND, (fragment, o["predicted_step_s"])
        assert o["step_error"] < -0.10 and _row(fragment).caveat  # > 10% off: the caveat says why
        run = cal.peer_models.MODELS[_row(fragment).peer]
        cost = CostModel(_row(fragment).workload(), _row(fragment).load_cluster())
        assert run(cost, _row(fragment).load_cluster(), cal._settings(_row(fragment), 0.0)).where == where


def test_sd35_generation_predictions_stay_in_the_reported_band(calibration):
    cal, f = calibration
    g = cal.sd35_generation(f)
    assert [r["max_num_seqs"] for r in g["rows"]] == sorted(SD35_GENERATION)
    for r in g["rows"]:
        published, reported = SD35_GENERATION[r["max_num_seqs"]]
        assert r["published_s"] == published and math.isfinite(r["predicted_s"])
        assert abs(r["predicted_s"] / reported - 1) <= BAND, r
    assert g["rows"][1]["images_per_forward"] == 32  # 64 images over 2 servers, max_num_seqs 256


def test_separate_async_keeps_a_published_split_and_refuses_an_empty_pool():
    setup = _row("1 actor")
    w, cluster = setup.workload(), setup.load_cluster()
    cost = CostModel(w, cluster)
    s = replace(verl.PUBLISHED, **setup.settings)
    assert verl.verl_omni_separate_async(cost, cluster, s).where == "R 2xH800 / T 1xH800"
    assert not verl.verl_omni_separate_async(cost, cluster, replace(s, rollout_gpus=3)).fits
    best = verl.verl_omni_separate_async(cost, cluster, replace(s, rollout_gpus=None))
    assert best.fits and best.iteration_s <= verl.verl_omni_separate_async(cost, cluster, s).iteration_s


def test_fsdp_size_one_drops_the_parameter_all_gather():
    """MM-GRPO's fsdp_size=1: a replica per GPU, no all-gather per forward (veRL-Omni shards over all)."""
    setup = _row("2 actor")
    cost = CostModel(setup.workload(), setup.load_cluster())
    s = replace(verl.PUBLISHED, **setup.settings)
    sharded = verl.verl_omni_phases(cost, "H800", 2, replace(s, fsdp_size=0))
    replica = verl.verl_omni_phases(cost, "H800", 2, s)
    assert replica["update_actor"] < sharded["update_actor"]
    assert replica["generation"] == pytest.approx(sharded["generation"])
