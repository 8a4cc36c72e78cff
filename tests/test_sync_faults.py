"""Failure semantics of the weight-sync group that never rely on a peer raising (NCCL peers hang):
the driver takes a group down through its store and every member's waiting collective and unit
boundary end at once; NCCL groups get the timeout they are given; and, end to end, a rollout
worker killed in the middle of a broadcast leaves trainer rank 0 alive while the other rollout
worker gets that version through the object store (issue 36, items 0 and 3)."""

from __future__ import annotations

import datetime
import os
import socket
import threading
from collections import Counter

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(port: int):
    """Rank 0 and rank 1 of a two-member gloo SyncGroup, formed in two threads of this process."""
    from digenrl.distributed.broadcast import SyncGroup

    out = {}

    def member(rank):
        out[rank] = SyncGroup(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=120)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[0], out[1]


def test_the_driver_takes_a_group_down_and_a_waiting_unit_boundary_hears_it():
    """Rank 0 announces version 1 and sends its header, then stops (a member lost with the rest of the
    broadcast: nothing fails on this side, as with NCCL). The receiver's thread waits inside the
    broadcast and its unit boundary waits for version 1; the driver closes the group through its
    store (:func:`close_group`): the boundary raises ``VersionMissed`` (the driver then sends the
    unit again with an object-store copy) and every member's end is aborted. On 849bed7 the boundary
    waited for the thread's collective to time out (300 s), then raised a plain WeightSyncError."""
    import json

    from digenrl.distributed.broadcast import close_group
    from digenrl.engine.sync_group import BroadcastInbox, VersionMissed, _announced

    port = _port()
    source, sink = _pair(port)
    inbox = BroadcastInbox(sink, max_staleness=0)
    source.store.set(_announced(0), "1")
    header = {"version": 1, "bucket_bytes": 64, "tensors": [["w", [4], "float32"]]}
    source.broadcast_bytes(json.dumps(header).encode(), 0)  # ... and no bucket ever follows
    outcome = {}

    def boundary():
        try:
            inbox.take(1)
        except VersionMissed as exc:
            outcome["missed"] = str(exc)

    waiting = threading.Thread(target=boundary, daemon=True)
    waiting.start()
    assert close_group(("127.0.0.1", port))
    waiting.join(60)  # (a guard against a hang, not a timing assertion: it returns at once)
    assert "version 1 were not received by broadcast" in outcome.get("missed", "")
    assert source.down.wait(60) and sink.down.wait(60)  # both ends aborted by their watchers
    assert source.pg is None and sink.pg is None
    assert 1 not in inbox.staged


def test_a_closed_group_refuses_collectives_and_a_version_already_staged_is_still_served():
    """Once down, a member's collectives raise at once instead of waiting; a version the inbox staged
    before the group went down is still handed to the unit boundary."""
    from digenrl.distributed.broadcast import WeightBroadcaster
    from digenrl.distributed.staged import sync_targets
    from digenrl.engine.sync_group import BroadcastInbox, _announced
    from digenrl.errors import WeightSyncError

    source, sink = _pair(_port())
    inbox = BroadcastInbox(sink, max_staleness=1)
    net = torch.nn.Linear(3, 2)
    source.store.set(_announced(0), "2")
    WeightBroadcaster(source).publish(2, sync_targets(net, lora=False))
    staged = inbox.take(2)
    source.close()
    assert sink.down.wait(60)
    assert inbox.take(2) is staged
    with pytest.raises(WeightSyncError, match="taken down"):
        source.broadcast(torch.zeros(1), 0)


def test_nccl_groups_get_the_timeout_they_are_given(monkeypatch):
    """``ProcessGroupNCCL`` is built with options carrying the group's timeout (849bed7 built it
    without options: ``timeout_s`` was ignored and a dead peer left the others waiting NCCL's default).
    The CPU build has no NCCL: a stand-in records what the group is built with."""
    import torch.distributed as dist

    from digenrl.distributed import broadcast

    built = {}

    class NCCLOptions:
        _timeout = None

    class FakeNCCL:
        Options = NCCLOptions

        def __init__(self, store, rank, world, *rest):
            built.update(rank=rank, world=world, options=rest[0] if rest else None)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    group = broadcast.SyncGroup(0, 1, "127.0.0.1", _port(), backend="nccl", timeout_s=42)
    assert built["options"] is not None
    assert built["options"]._timeout == datetime.timedelta(seconds=42)
    group.close()


# -- end to end: a rollout worker killed mid-broadcast ------------------------------------------


def _routes(rejoined_at=None):
    """The driver's SyncRoutes over broadcast with two rollout workers, rank 0 a stand-in actor whose
    ``publish`` hands out a marked object-store reference."""
    from types import SimpleNamespace

    from digenrl.engine.weight_sync import SyncRoutes

    rank0 = SimpleNamespace(
        publish=SimpleNamespace(remote=lambda: "rank0-copy"),
        export_staged=SimpleNamespace(remote=lambda v: f"rank0-kept-{v}"),
    )
    routes = SyncRoutes("broadcast", ["rollout0", "rollout1"], 0, {"trainer0": rank0}, "trainer0")
    routes.rejoined_at = rejoined_at
    return routes


def test_after_a_regroup_a_later_fallback_sends_the_version_by_object_store():
    """The group re-formed once (a restarted worker rejoined at version 2); then rollout1 dies while
    rank 0 broadcasts version 5. rollout0's next unit of version 5 must carry rank 0's object-store
    copy: the re-formed group is the one that broke. On 849bed7 the driver still sent it to its inbox
    (``None``): the worker waited 300 s on the broken group and the run stopped (the soak, issue 36)."""
    from types import SimpleNamespace

    routes = _routes(rejoined_at=2)
    routes.held = {"rollout0": 4, "rollout1": 4}
    routes.publishing = 5
    assert routes.for_rollout("rollout0", SimpleNamespace(version=3), 4) is None  # (still on broadcast)
    routes.worker_died("rollout1", 4)
    assert routes.transport == "object_store"
    assert routes.for_rollout("rollout0", SimpleNamespace(version=5), 4) == "rank0-copy"


def test_a_missed_version_goes_again_with_rank_0s_copy():
    """A unit boundary that found the group down without its version (``VersionMissed``): the driver
    falls back and the same unit, sent again, carries rank 0's copy of that version -- the one it
    holds, else the one it kept of what it broadcast."""
    from types import SimpleNamespace

    routes = _routes()
    unit = SimpleNamespace(version=3)
    assert routes.for_rollout("rollout0", unit, 3) is None  # its inbox is to have it
    routes.missed("rollout0", unit, 3)
    assert routes.transport == "object_store"
    assert routes.for_rollout("rollout0", unit, 3) == "rank0-copy"
    older = SimpleNamespace(version=2)
    routes.missed("rollout1", older, 3)  # rank 0 has moved on: the copy it kept
    assert routes.for_rollout("rollout1", older, 3) == "rank0-kept-2"


@pytest.mark.slow
@pytest.mark.faults
def test_a_rollout_worker_killed_mid_broadcast_leaves_the_run_going(ray_cluster, tmp_path):
    """Two rollout workers over broadcast, one-step async; rollout1 dies after the header of version 2
    arrives (``{worker: rollout1, unit: sync-2}``: mid-broadcast, the fault of the soak). Trainer rank
    0 stays alive, the run falls back to the object store (the driver takes the group down), rollout0
    loads version 2 from rank 0's object-store copy, and every (iteration, group) is trained exactly
    once."""
    from digenrl.config.run import load_config
    from digenrl.engine.timeline import Timeline
    from digenrl.launch import run_engine
    from tests.helpers import QUIET, TINY

    sets = [
        *TINY,
        *QUIET,
        "placement.mode=disaggregated",
        "engine.gap=true",
        "engine.tag=false",
        "engine.tsp_degree=1",
        "engine.max_staleness=1",
        "engine.weight_sync=broadcast",
        "train.iterations=4",
        "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
        "engine.faults=[{worker: rollout1, unit: sync-2}]",
    ]
    result = run_engine(load_config(None, sets), tmp_path / "run")
    assert [r["iteration"] for r in result.metrics] == [0, 1, 2, 3]
    assert result.metrics[-1]["worker_restarts"] == 1
    tl = Timeline.from_chrome_trace(tmp_path / "run" / "timeline.json")
    trained = Counter((t.iteration, g) for t in tl.of("train") for g in t.args["groups"])
    assert trained == Counter({(k, g): 1 for k in range(4) for g in range(2)})
    publishes = {e.version: e for e in tl.of("sync") if e.args["direction"] == "publish"}
    assert publishes[1].args["transport"] == "broadcast"  # before the fault
    assert all(p.worker == "trainer0" for p in publishes.values())
    loads = [e for e in tl.of("sync") if e.args["direction"] == "fetch" and e.version == 2]
    assert loads and all(e.args["transport"] == "object_store" for e in loads if e.worker == "rollout0")


@pytest.mark.slow
@pytest.mark.faults
def test_a_blocked_group_member_is_detected_by_the_driver_and_its_group_restarted(ray_cluster, tmp_path):
    """The follower of a sequence-parallel rollout pair BLOCKS as its share of a unit starts (alive,
    never answering: ``:start:block``), so its lead waits in the unit's first all-to-all and nothing
    raises anywhere (as with NCCL). The driver sees the call run past ``engine.group_timeout_s``, takes
    the pair down, Ray restarts it, and the unit is generated again once: nothing lost, nothing
    duplicated. On 849bed7 the lead waited out the group's 30-minute collective timeout."""
    from digenrl.config.run import load_config
    from digenrl.engine.timeline import Timeline
    from digenrl.launch import run_engine
    from tests.helpers import QUIET, TINY, assert_timeline_invariants

    sets = [
        *TINY,
        *QUIET,
        "train.iterations=2",
        "engine.tsp_degree=1",
        "engine.max_staleness=0",
        "placement.mode=disaggregated",
        "engine.tag=false",
        "engine.gap=false",
        "engine.rollout_sp=2",
        "engine.group_timeout_s=8",
        "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
        "engine.faults=[{worker: rollout1, unit: 'rollout-0-1:start:block'}]",
    ]
    cfg = load_config(None, sets)
    result = run_engine(cfg, run_dir=tmp_path / "run")
    assert [r["iteration"] for r in result.metrics] == [0, 1]
    assert result.metrics[-1]["worker_restarts"] >= 1
    tl = Timeline.from_chrome_trace(tmp_path / "run" / "timeline.json")
    assert_timeline_invariants(cfg, tl)  # every group generated once (as recorded) and trained once
    assert Counter(r.uid for r in tl.of("rollout"))["rollout-0-1"] == 1


@pytest.mark.parametrize(
    ("sets", "devices", "backend"),
    [
        ([], ["cuda:0", "cuda:0", "cuda:0"], "nccl"),
        (["engine.rollout_sp=2"], ["cuda:0", "cuda:0", "cuda:0"], "gloo"),
        ([], ["cuda:0", "cpu", "cpu"], "gloo"),
    ],
    ids=["gpus", "gpus_with_rollout_sp", "a_cpu_member"],
)
def test_no_second_nccl_communicator_beside_a_sequence_parallel_all_to_all(tiny_cfg, sets, devices, backend):
    """Item 9: a rollout worker of a sequence-parallel group all-to-alls over NCCL while its inbox
    receives on a background thread; the weight-sync group is then gloo (host buffers, no second
    NCCL communicator with kernels on that GPU). 849bed7 chose NCCL whenever every member was on a GPU."""
    from digenrl.engine.sync_group import sync_backend
    from digenrl.placement.resolve import resolve

    layout = resolve(
        tiny_cfg(
            "placement.mode=disaggregated",
            "engine.tag=false",
            "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
            *sets,
        )
    )
    assert bool(layout.rollout_sp_groups) == bool(sets)
    assert sync_backend(devices, layout) == backend


def test_the_driver_takes_an_overdue_group_down_once():
    """``GroupRestart.watch``: a call past ``engine.group_timeout_s`` takes its worker's group down --
    an SP rollout group whole, a trainer rank with every trainer rank -- once per call (its failure
    then comes as a death's); a rollout worker of no group alone; calls within the limit untouched."""
    import time

    from digenrl.engine.recovery import GroupRestart

    roles = {"rollout0": "rollout", "rollout1": "rollout", "rollout2": "rollout", "trainer0": "trainer"}
    roles["trainer1"] = "trainer"
    watch = GroupRestart({"rollout0": ["rollout0", "rollout1"]}, {}, None, timeout_s=0.0)
    in_flight = {"a": ("rollout0", None), "b": ("trainer1", None), "c": ("rollout2", None)}
    assert watch.watch(in_flight, roles) == []  # just seen
    time.sleep(0.01)
    assert watch.watch(in_flight, roles) == ["rollout0", "rollout1", "rollout2", "trainer0", "trainer1"]
    assert watch.watch(in_flight, roles) == []  # once
    patient = GroupRestart({}, {}, None, timeout_s=3600.0)
    patient.watch(in_flight, roles)
    assert patient.watch(in_flight, roles) == []


@pytest.mark.slow
@pytest.mark.faults
def test_a_missed_broadcast_inside_a_sequence_parallel_group_falls_back(ray_cluster, tmp_path, capsys):
    """A sequence-parallel rollout pair over broadcast; the follower's end of the weight-sync group
    breaks once version 2 is in, before it is staged (``sync-2:received:drop``: it misses the version
    and lives on; rank 0 has published it, the lead holds it). The pair agrees
    that a member missed it before any of its collectives, the lead answers "missed", the driver
    falls back to the object store and sends the unit again with rank 0's copy, which both members
    load: the run finishes with no restart, every group generated and trained once. Before, the
    follower aborted its group on its VersionMissed while its lead, which held the version, waited in
    the unit's first all-to-all: the run stalled (still waiting when killed at 300 s; the group's
    collective timeout is 30 min)."""
    from digenrl.config.run import load_config
    from digenrl.engine.timeline import Timeline
    from digenrl.launch import run_engine
    from tests.helpers import QUIET, TINY, assert_timeline_invariants

    sets = [
        *TINY,
        *QUIET,
        "placement.mode=disaggregated",
        "engine.gap=false",
        "engine.tag=false",
        "engine.tsp_degree=1",
        "engine.max_staleness=0",
        "engine.weight_sync=broadcast",
        "engine.rollout_sp=2",
        "train.iterations=3",
        "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
        "engine.faults=[{worker: rollout1, unit: 'sync-2:received:drop'}]",
    ]
    cfg = load_config(None, sets)
    result = run_engine(cfg, tmp_path / "run")
    err = capsys.readouterr().err
    assert [r["iteration"] for r in result.metrics] == [0, 1, 2]
    assert result.metrics[-1]["worker_restarts"] == 0  # nobody died: the pair went on
    # the follower's broken end takes the sync group down; which side names it first is a race: the
    # lead's "missed" (the path this test is for), or rank 0 still finishing version 2's broadcast
    # (seen once in four suite runs). Either way the pair falls back and the run goes on.
    missed = "weight sync falls back to the Ray object store for the rest of the run (rollout0 missed it)"
    rank0 = "weight sync falls back to the Ray object store for the rest of the run (trainer rank 0 could"
    assert missed in err or rank0 in err, err
    tl = Timeline.from_chrome_trace(tmp_path / "run" / "timeline.json")
    assert_timeline_invariants(cfg, tl)
    publishes = {e.version: e for e in tl.of("sync") if e.args["direction"] == "publish"}
    if missed in err:
        assert publishes[2].args["transport"] == "broadcast"  # rank 0 sent it; the follower lost it
    assert publishes[3].args["transport"] == "object_store"  # after the fallback
