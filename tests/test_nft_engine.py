"""DiffusionNFT on the Ray engine: on-policy (``max_staleness: 0``) it equals the single-process
trainer with TSP 2 (the noise levels split over two trainer ranks) and with FSDP x2 (the old policy
sharded like the weights; with uneven shares beside TAG too, in lockstep); the default demo
(disaggregated, GAP + TAG + one-step async) learns, with
the timeline invariants of docs/architecture.md holding. On the suite's Ray cluster (conftest)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from digenrl.run.rundir import read_metrics  # noqa: E402
from tests.helpers import FULL_MODE, TINY  # noqa: E402

pytestmark = pytest.mark.slow

NFT = ["algorithm.name=diffusion_nft"]
BASE = NFT + [
    *TINY,
    *FULL_MODE,  # the knobs a test leaves unset: the engine's full mode's, not the default run's
    "train.iterations=2",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
]
TWO_TRAINERS = [
    "placement.mode=disaggregated",
    "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
]
MODES = {
    "tsp2": TWO_TRAINERS + ["engine.tag=true", "engine.tsp_degree=2"],
    "fsdp2": TWO_TRAINERS + ["engine.tag=false", "engine.gap=false", "train.fsdp=2"],
}
LORA = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    path = tmp_path_factory.mktemp("nft-local")
    result = LocalTrainer(load_config(None, BASE)).run(path)
    return load_file(path / "final" / LORA), result.metrics


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_equals_the_local_trainer_on_policy(mode, cluster, local, tmp_path):
    cfg = load_config(None, BASE + MODES[mode])
    result = run_engine(cfg, run_dir=tmp_path)
    check_invariants(cfg, tmp_path)
    want, ref_rows = local
    got = load_file(tmp_path / "final" / LORA)
    assert got.keys() == want.keys()
    # the same summed gradient in another order (TSP ranks / FSDP shares): test_engine's tolerances
    for k in got:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref_rows):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
        assert mine["nft_r"] == pytest.approx(0.5, abs=1e-6)  # the optimality probability averages 1/2
    if mode == "tsp2":  # each rank trained its half of the noise levels of every group
        trains = Timeline.from_chrome_trace(tmp_path / "timeline.json").of("train")
        assert {t.args["tsp_rank"] for t in trains} == {0, 1}


def test_sharded_nft_with_uneven_shares_equals_the_local_trainer(cluster, tmp_path):
    """FSDP x2 beside TAG, each unit a group of 3 samples (2 + 1 over the ranks, micro-batch 1): the
    rank with one micro-batch fewer runs the other's passes weighted 0, so the collectives match
    (lockstep) and the update is the unsharded one."""
    uneven = ["algorithm.group_size=3", "train.micro_batch=1"]
    ref = LocalTrainer(load_config(None, BASE + uneven)).run(tmp_path / "local")
    cfg = load_config(None, BASE + uneven + TWO_TRAINERS + ["engine.tag=true", "train.fsdp=2"])
    result = run_engine(cfg, run_dir=tmp_path / "fsdp")
    check_invariants(cfg, tmp_path / "fsdp")
    want, got = (load_file(tmp_path / d / "final" / LORA) for d in ("local", "fsdp"))
    assert got.keys() == want.keys()
    for k in got:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)


def test_default_demo_learns_on_the_async_engine(cluster, tmp_path):
    """``digenrl train -c configs/flux_tiny_disaggregated.yaml --set algorithm.name=diffusion_nft``: the
    demo on the engine's full mode (disaggregated, GAP, TAG, one-step async), shortened; the reward mean
    of the last third above the first third."""
    cfg = load_config(
        None,
        NFT + FULL_MODE + ["train.iterations=36", "output.checkpoint_every=0", "output.save_samples_every=0"],
    )
    e = cfg.engine
    assert (cfg.placement.mode, e.gap, e.tag, e.max_staleness) == ("disaggregated", True, True, 1)
    run_engine(cfg, run_dir=tmp_path)
    check_invariants(cfg, tmp_path)
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path)]
    third = len(rewards) // 3
    first, last = sum(rewards[:third]) / third, sum(rewards[-third:]) / third
    assert last > first + 0.02, (first, last)


def check_invariants(cfg, run_dir) -> None:
    """Every group of every iteration generated once by one version within the staleness bound, and
    trained exactly once per TSP rank from samples of one version at most max_staleness old."""
    tl = Timeline.from_chrome_trace(run_dir / "timeline.json")
    n_iter, n_groups, stale = cfg.train.iterations, cfg.train.prompts_per_iteration, cfg.engine.max_staleness
    rollouts, trains = tl.of("rollout"), tl.of("train")
    assert Counter((r.iteration, g) for r in rollouts for g in r.args["groups"]) == Counter(
        {(k, g): 1 for k in range(n_iter) for g in range(n_groups)}
    )
    assert all(r.iteration - stale <= r.version <= r.iteration for r in rollouts)
    degree = {t.args["tsp_degree"] for t in trains}
    assert len(degree) == 1
    (d,) = degree
    assert Counter((t.iteration, g, t.args["tsp_rank"]) for t in trains for g in t.args["groups"]) == Counter(
        {(k, g, r): 1 for k in range(n_iter) for g in range(n_groups) for r in range(d)}
    )
    made_by = {(r.iteration, tuple(r.args["groups"])): r.version for r in rollouts}
    for t in trains:
        assert len(t.sample_versions) == 1 and t.version == t.iteration
        assert 0 <= t.version - t.sample_versions[0] <= stale
        assert made_by[(t.iteration, tuple(t.args["groups"]))] == t.sample_versions[0]
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == list(range(n_iter))
    assert all(0 <= r["bubble_fraction"] < 1 for r in rows)
