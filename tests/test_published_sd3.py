"""The SD3.5 published figures (digenrl/planner/published_sd3.py): the cited numbers as published, and the
predictions of the fit of every row (planner/cost_fit.json) within the bands docs/scaling/sd35_rows.md
reports."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from digenrl.planner import peer_verl_omni as verl
from digenrl.planner import published_fit
from digenrl.planner.costmodel import CostModel
from digenrl.planner.published import NOT_CHECKED, OUT_OF_SAMPLE
from digenrl.planner.published_sd3 import MM_GRPO, VERL_OMNI_SD35_GENERATION

ROOT = Path(__file__).resolve().parents[1]

#: MM-GRPO's table (README.md:95-97 @d91797e): name fragment -> (prompts, images/GPU/s, pool split,
#: the predicted s/step docs/scaling/sd35_rows.md reports)
MM_TABLE = {
    "1 actor + 2 rollout": (8, 1.07, "R 2xH800 / T 1xH800", 16.7),
    "2 actor + 1 rollout": (16, 1.25, "R 1xH800 / T 2xH800", 37.8),
    "hybrid engine": (24, 1.42, "3xH800", 49.1),
}
#: veRL-Omni docs/start/rollout_batching.md:132: max_num_seqs -> (published s, predicted s reported)
SD35_GENERATION = {1: (25.4, 14.8), 256: (22.3, 14.8)}
#: how far a prediction may move from the reported one before the test calls it a regression
BAND = 0.25


@pytest.fixture(scope="module")
def full():
    from digenrl.planner.uncertainty import fits

    return fits()["all"]


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


def test_mm_grpo_predictions_stay_in_the_reported_band(full):
    """The peer model on the published split, under the fit of every row: the step each row reports."""
    for fragment, (_, _, where, reported) in MM_TABLE.items():
        run = published_fit.peer_run(_row(fragment), full)
        assert math.isfinite(run.iteration_s) and abs(run.iteration_s / reported - 1) <= BAND, fragment
        assert run.where == where


def test_sd35_generation_predictions_stay_in_the_reported_band(full):
    for batch, (published, reported) in SD35_GENERATION.items():
        assert VERL_OMNI_SD35_GENERATION.points[batch] == published
        got = published_fit.sd35_generation(full, batch)
        assert math.isfinite(got) and abs(got / reported - 1) <= BAND, batch


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
