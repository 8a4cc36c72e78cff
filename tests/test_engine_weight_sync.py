"""Broadcast weight sync wired into the engine (``engine.weight_sync``): trainer
rank 0 broadcasts each version to the rollout workers over a gloo group; they receive it on a
background thread while generating and load it at the next unit boundary, checking every
tensor's fingerprint. Tiny FLUX, local Ray, 2-3 iterations."""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.errors import WeightSyncError  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from tests.helpers import QUIET, TINY  # noqa: E402

BASE = [
    *TINY,
    *QUIET,
    "placement.mode=disaggregated",
    "engine.gap=true",
    "engine.tag=false",
    "engine.tsp_degree=1",
    "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


def sync_events(run_dir) -> tuple[Timeline, dict[int, dict], dict[int, list]]:
    """The timeline, rank 0's publish event per version, and every rollout worker's loads per version."""
    tl = Timeline.from_chrome_trace(run_dir / "timeline.json")
    publishes = {e.version: e for e in tl.of("sync") if e.args["direction"] == "publish"}
    loads = defaultdict(list)
    for e in tl.of("sync"):
        if e.args["direction"] == "fetch":  # the load at a unit boundary
            loads[e.version].append(e)
    return tl, publishes, loads


def check_versions_equal(tl: Timeline, publishes: dict, loads: dict, iterations: int) -> None:
    """Every version went out by broadcast from trainer0, and every load of it on a rollout worker
    holds the same keys and fingerprints (a digest of names + per-tensor fingerprints, computed by
    the source from what it sent and by each receiver from what it loaded)."""
    assert sorted(publishes) == list(range(1, iterations + 1))
    assert all(p.worker == "trainer0" and p.args["transport"] == "broadcast" for p in publishes.values())
    assert loads and set(loads) <= set(range(1, iterations))  # the last version is published, never needed
    for version, events in loads.items():
        assert {e.worker for e in events} <= {"rollout0", "rollout1"}
        for e in events:
            assert e.args["transport"] == "broadcast"
            assert e.args["digest"] == publishes[version].args["digest"], (version, e.worker)
            assert e.args["bytes"] == publishes[version].args["bytes"] > 0
    # a unit runs with one version: every load lies outside the rollout spans of its worker
    for e in (e for events in loads.values() for e in events):
        assert not any(r.worker == e.worker and r.start < e.start < r.end for r in tl.of("rollout"))


def final_lora(run_dir) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "pytorch_lora_weights.safetensors")


@pytest.mark.faults
def test_broadcast_equals_the_object_store_run(cluster, tmp_path):
    """On-policy (max_staleness 0), LoRA, 2 rollout workers: the broadcast run trains exactly what
    the object-store run trains -- also when a rollout worker dies after version 1 went out by
    broadcast (the rest of the run goes through the object store)."""
    sets = BASE + ["train.iterations=2", "engine.max_staleness=0"]
    bcast = run_engine(load_config(None, sets + ["engine.weight_sync=broadcast"]), tmp_path / "bcast")
    store = run_engine(load_config(None, sets + ["engine.weight_sync=object_store"]), tmp_path / "store")
    # both rollout workers are idle when iteration 1 starts: rollout1 takes unit 1 and dies after its work
    fault = run_engine(
        load_config(
            None,
            sets + ["engine.weight_sync=broadcast", "engine.faults=[{worker: rollout1, unit: rollout-1-1}]"],
        ),
        tmp_path / "fault",
    )
    assert fault.metrics[-1]["worker_restarts"] == 1
    _, fault_publishes, _ = sync_events(tmp_path / "fault")
    assert fault_publishes[1].args["transport"] == "broadcast"  # (then the group re-forms once rollout1
    # is back, or version 2 goes through the object store if it is not back yet)
    assert [r["reward_mean"] for r in fault.metrics] == pytest.approx(
        [r["reward_mean"] for r in store.metrics], rel=1e-5
    )
    c = final_lora(tmp_path / "fault")
    tl, publishes, loads = sync_events(tmp_path / "bcast")
    check_versions_equal(tl, publishes, loads, iterations=2)
    assert sorted(e.worker for e in loads[1]) == ["rollout0", "rollout1"]  # both generated with version 1
    _, store_publishes, store_loads = sync_events(tmp_path / "store")
    assert all(p.args["transport"] == "object_store" for p in store_publishes.values())
    assert all(e.args["transport"] == "object_store" for events in store_loads.values() for e in events)
    # two rollout workers finish their units in either order, so the trainer sums the gradient in
    # either order: equal up to that, as in test_engine (1e-4 = 1% of one lr=1e-2 step)
    a, b = final_lora(tmp_path / "bcast"), final_lora(tmp_path / "store")
    assert a.keys() == b.keys() == c.keys()
    for other in (a, c):
        diff = max(float((other[k] - b[k]).abs().max()) for k in b)
        assert diff < 1e-4, diff
    assert [r["reward_mean"] for r in bcast.metrics] == pytest.approx(
        [r["reward_mean"] for r in store.metrics], rel=1e-5
    )


def test_full_weights_prefetched_while_generating(cluster, tmp_path):
    """Full fine-tune (model.lora=null), one-step async: versions arrive while the rollout worker
    generates. One rollout worker is the slow side here (40 sampling steps per sample, one trained),
    so when the trainer steps it is already generating the next iteration with the previous version,
    in units several times longer than a version takes to arrive: the timeline shows a prefetch span
    inside a rollout span of the same worker."""
    sets = BASE + [
        "model.lora=null",
        "train.iterations=3",
        "engine.max_staleness=1",
        "sampling.steps=40",
        "algorithm.timesteps.fraction=0.025",
        "algorithm.kl_beta=0",
        "train.prompts_per_iteration=4",
        "engine.weight_sync=auto",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]",
    ]
    run_engine(load_config(None, sets), tmp_path / "full")
    tl, publishes, loads = sync_events(tmp_path / "full")
    check_versions_equal(tl, publishes, loads, iterations=3)
    # (a prefetch is reported with the worker's next unit: one after its last unit is not on the timeline)
    prefetches = [e for e in tl.of("sync") if e.args["direction"] == "prefetch"]
    assert {(e.worker, e.version) for e in prefetches} >= {
        (e.worker, e.version) for v in loads for e in loads[v]
    }
    rollouts = tl.of("rollout")
    inside = [
        p
        for p in prefetches
        if any(r.worker == p.worker and r.start <= p.start <= p.end <= r.end for r in rollouts)
    ]
    assert inside, [(p.worker, p.version, p.start, p.end) for p in prefetches]


@pytest.mark.faults
def test_a_corrupted_bucket_is_detected_and_named(cluster, tmp_path):
    """A bit flipped in transit in the first bucket of version 1 (fault plugin on trainer0): the
    rollout worker that loads it refuses, naming the tensor and its bucket; the run stops."""
    sets = BASE + [
        "train.iterations=2",
        "engine.max_staleness=0",
        "engine.weight_sync=broadcast",
        "engine.faults=[{worker: trainer0, unit: sync-1}]",
    ]
    with pytest.raises(
        WeightSyncError,
        match=r"broadcast of version 1: fingerprint mismatch after load in 1 "
        r"tensors, first \S+ \(bucket 0\)",
    ):
        run_engine(load_config(None, sets), tmp_path / "run")


@pytest.mark.faults
def test_one_step_async_survives_a_dead_rollout_worker(cluster, tmp_path):
    """max_staleness 1, one rollout worker over broadcast, killed after generating a unit of iteration
    2 (with version 1, while the trainer may already have published version 2): the restarted worker
    rejoins the group, and gets the version of its re-queued unit from rank 0 (the one it sends over
    the re-formed group, else its current weights or the copy it kept of what it broadcast, through
    the object store); every group is still trained exactly once."""
    sets = BASE + [
        "train.iterations=3",
        "engine.max_staleness=1",
        "engine.weight_sync=broadcast",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]",
        "engine.faults=[{worker: rollout0, unit: rollout-2-0}]",
    ]
    result = run_engine(load_config(None, sets), tmp_path / "run")
    assert [r["iteration"] for r in result.metrics] == [0, 1, 2] and result.metrics[-1][
        "worker_restarts"
    ] == 1
    tl, publishes, loads = sync_events(tmp_path / "run")
    trained = Counter((t.iteration, g) for t in tl.of("train") for g in t.args["groups"])
    assert trained == Counter({(k, g): 1 for k in range(3) for g in range(2)})
    # once the worker is back the group re-forms: version 3 goes out by broadcast again
    assert publishes[1].args["transport"] == "broadcast" and publishes[3].args["transport"] == "broadcast"
    regenerated = [r for r in tl.of("rollout") if r.uid == "rollout-2-0"]
    assert len(regenerated) == 1 and 0 <= 2 - regenerated[0].version <= 1
    # the restarted worker (back at version 0) fetched the unit's version: from the object store when
    # it is older than the one rank 0 sent over the re-formed group, else from that broadcast
    unit = regenerated[0]
    (resent,) = [e for e in tl.of("sync") if e.args.get("rejoin")]
    transport = "object_store" if unit.version < resent.version else "broadcast"
    assert [e for e in loads[unit.version] if e.args["transport"] == transport and e.end <= unit.start + 1e-3]


@pytest.mark.faults
def test_a_restarted_rollout_worker_rejoins_the_broadcast_group(cluster, tmp_path):
    """One rollout worker over broadcast, killed after generating a unit of iteration 1 (version 1):
    once it is back the group re-forms with it, trainer rank 0 sends version 1 over the new group
    once, and the worker's regenerated unit loads it from its inbox -- by broadcast, not the object
    store, every fingerprint checked (the load's digest is the one rank 0 sent). Later versions go
    by broadcast again, and the run equals the fault-free one."""
    sets = BASE + [
        "train.iterations=3",
        "engine.max_staleness=0",
        "engine.weight_sync=broadcast",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]",
    ]
    clean = run_engine(load_config(None, sets), tmp_path / "clean")
    result = run_engine(
        load_config(None, sets + ["engine.faults=[{worker: rollout0, unit: rollout-1-0}]"]), tmp_path / "run"
    )
    assert result.metrics[-1]["worker_restarts"] == 1
    tl, publishes, loads = sync_events(tmp_path / "run")
    resent = [e for e in tl.of("sync") if e.args.get("rejoin")]
    assert len(resent) == 1 and resent[0].version == 1 and resent[0].args["transport"] == "broadcast"
    assert all(publishes[v].args["transport"] == "broadcast" for v in (1, 2, 3))
    regenerated = [r for r in tl.of("rollout") if r.uid == "rollout-1-0"]
    assert len(regenerated) == 1 and regenerated[0].version == 1
    fetched = [e for e in loads[1] if e.end <= regenerated[0].start + 1e-3 and e.start >= resent[0].start]
    assert fetched and all(e.args["transport"] == "broadcast" for e in fetched)
    assert all(e.args["digest"] == resent[0].args["digest"] for e in fetched)
    assert all(e.args["transport"] == "broadcast" for v in (1, 2) for e in loads[v])
    trained = Counter((t.iteration, g) for t in tl.of("train") for g in t.args["groups"])
    assert trained == Counter({(k, g): 1 for k in range(3) for g in range(2)})
    a, b = final_lora(tmp_path / "run"), final_lora(tmp_path / "clean")
    assert max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-4
    assert [r["reward_mean"] for r in result.metrics] == pytest.approx(
        [r["reward_mean"] for r in clean.metrics], rel=1e-5
    )
