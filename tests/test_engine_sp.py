"""Sequence-parallel workers in the engine: two gloo devices as one rollout worker
(``engine.rollout_sp: 2``) or as one trainer rank (``engine.trainer_sp: 2``) run every unit
together (Ulysses over their group; the scheduler sees the lead only); on-policy, the run
equals the single-process trainer."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from tests.helpers import TINY  # noqa: E402
from tests.test_timeline import with_followers_replicated  # noqa: E402

BASE = [
    *TINY,
    "train.iterations=2",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
]
ENGINE = ["placement.mode=disaggregated", "engine.tag=false", "engine.gap=false"]
CASES = {  # the sequence-parallel pair, and the run's other pool: replicated ranks / the SP rollout worker
    "rollout_sp": (
        ["engine.rollout_sp=2", "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]"],
        "rollout",
        "rollout0",
    ),
    "trainer_sp": (
        ["engine.trainer_sp=2", "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]"],
        "train",
        "trainer0",
    ),
    # SP inside FSDP: 4 trainer devices sharded together, two sequence-parallel groups of 2
    "trainer_sp_in_fsdp": (
        [
            "engine.trainer_sp=2",
            "train.fsdp=4",
            "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 4}]",
        ],
        "train",
        "trainer0",
    ),
}


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref_dir = tmp_path_factory.mktemp("local")
    return ref_dir, LocalTrainer(load_config(None, BASE)).run(ref_dir)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_workers_equal_the_local_trainer(cluster, reference, tmp_path, case):
    sets, kind, lead = CASES[case]
    ref_dir, ref = reference
    result = run_engine(load_config(None, BASE + ENGINE + sets), run_dir=tmp_path / "sp")
    want = load_file(ref_dir / "final" / "pytorch_lora_weights.safetensors")
    got = load_file(tmp_path / "sp" / "final" / "pytorch_lora_weights.safetensors")
    assert got.keys() == want.keys()
    # samples / gradients equal to ~1e-6 (summed in another order), then the same update: the
    # tolerance of test_engine_fsdp (1% of one lr=1e-2 Adam step)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-3, abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)
    # the scheduler saw one worker for the pair: its lead ran every unit of that kind, with its
    # transformer over both devices
    tl = Timeline.from_chrome_trace(tmp_path / "sp" / "timeline.json")
    assert {t.worker for t in tl.of(kind)} == {lead} and len(tl.of(kind)) >= 2
    assert {t.args["sp"] for t in tl.of(kind)} == {2}
    # its followers compute with it: busy while it is, so the bubble is the equivalent 1-device workers'
    assert {f for f in tl.follows if tl.lead_of(f) == lead} == (
        {"rollout1"}
        if kind == "rollout"
        else {"trainer1", "trainer2", "trainer3"}
        if case == "trainer_sp_in_fsdp"
        else {"trainer1"}
    )
    flat = with_followers_replicated(tl)
    assert [r["bubble_fraction"] for r in tl.iteration_stats()] == pytest.approx(
        [r["bubble_fraction"] for r in flat.iteration_stats()]
    )


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.parametrize("when", ["", ":start"], ids=["after_its_share", "mid_unit"])
def test_a_lost_member_takes_its_sequence_parallel_group_down(cluster, reference, tmp_path, when):
    """The follower of a sequence-parallel rollout pair dies after its share of a unit, or as its share
    starts (``:start``: its lead then waits in the unit's first all-to-all, which fails as the
    follower's process goes): the lead's unit fails naming the dead member, the driver restarts the
    pair whole (its lead too), forms its group again and re-queues the unit exactly once; the run
    loses and duplicates nothing and equals the single-process trainer (and so the fault-free run,
    test above) within the same tolerance."""
    from collections import Counter

    from tests.helpers import assert_timeline_invariants

    ref_dir, ref = reference
    sets, _, _ = CASES["rollout_sp"]
    fault = f"engine.faults=[{{worker: rollout1, unit: 'rollout-0-1{when}'}}]"
    cfg = load_config(None, BASE + ENGINE + sets + [fault])
    result = run_engine(cfg, run_dir=tmp_path / "sp")
    assert result.metrics[-1]["worker_restarts"] >= 1
    tl = Timeline.from_chrome_trace(tmp_path / "sp" / "timeline.json")
    assert_timeline_invariants(cfg, tl)  # every group generated once (as recorded) and trained once
    assert Counter(r.uid for r in tl.of("rollout"))["rollout-0-1"] == 1
    want = load_file(ref_dir / "final" / "pytorch_lora_weights.safetensors")
    got = load_file(tmp_path / "sp" / "final" / "pytorch_lora_weights.safetensors")
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
        assert mine["samples"] == theirs["samples"]


WIRED = {  # sequence parallelism beside the engine's other features, each one SPMD group
    # an SP trainer pair assists generation (TAG): it generates each unit together, as an SP rollout pair
    "trainer_sp_tag": [
        "engine.trainer_sp=2",
        "engine.tag=true",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
    ],
    # SP rollout workers beside TAG trainer ranks, their TAG elastic (BTS)
    "rollout_sp_tag": [
        "engine.rollout_sp=2",
        "engine.tag=auto",
        "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
    ],
    # in-training eval on an SP trainer pair: the lead's evaluate runs on its follower too
    "trainer_sp_eval": [
        "engine.trainer_sp=2",
        "output.eval_every=1",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
    ],
    # colocated SP: every device generates and trains, in two SP pairs (replicated across them)
    "colocated_sp": [
        "placement.mode=colocated",
        "engine.trainer_sp=2",
        "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 2}]",
    ],
    # colocated FSDP (DanceGRPO's arrangement): both devices one shard group that generates and trains
    "colocated_fsdp": [
        "placement.mode=colocated",
        "train.fsdp=2",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]",
    ],
    # SP inside HSDP: 4 trainer devices, two shard groups of 2 (replicas), each one SP pair
    "trainer_sp_in_hsdp": [
        "engine.trainer_sp=2",
        "train.fsdp=2",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 4}]",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", WIRED)
def test_sequence_parallel_beside_tag_eval_and_hsdp_equals_the_local_trainer(
    cluster, reference, tmp_path, case
):
    from tests.helpers import assert_timeline_invariants

    ref_dir, ref = reference
    cfg = load_config(None, BASE + ENGINE + WIRED[case])
    result = run_engine(cfg, run_dir=tmp_path / "sp")
    want = load_file(ref_dir / "final" / "pytorch_lora_weights.safetensors")
    got = load_file(tmp_path / "sp" / "final" / "pytorch_lora_weights.safetensors")
    assert got.keys() == want.keys()
    for k in want:  # the tolerance of the test above
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)
    tl = Timeline.from_chrome_trace(tmp_path / "sp" / "timeline.json")
    assert_timeline_invariants(cfg, tl)
    if "engine.tag=true" in WIRED[case] and "engine.trainer_sp=2" in WIRED[case]:  # the pair generated
        assert [r for r in tl.of("rollout") if r.worker == "trainer0" and r.args["sp"] == 2]
    if case == "trainer_sp_eval":
        assert all(any(k.startswith("eval/") for k in row) for row in result.metrics)
    if case == "trainer_sp_in_hsdp":  # two replica groups, each a lead scheduled for its pair
        assert {t.worker for t in tl.of("train")} <= {"trainer0", "trainer2"}
