"""Multi-node for real, on one machine (issue 36): a Ray cluster of several nodes on localhost
(``ray.cluster_utils.Cluster``), built once for the module by ``tests/two_node_runs.py`` in a
subprocess (its own Ray, beside the suite's). A shard group or a sequence-parallel group runs
collectives every forward, so it must live on one node (``RunLayout.node_groups``: one STRICT_PACK
placement group each); a disaggregated run across two nodes equals the same run on one node bit for
bit; the trainer's node replaced mid-run restarts the run from its last checkpoint
(``engine.trainer_restarts``) with nothing lost or trained twice; a node lost for good stops the run
with one line naming it, exit code 2, the last checkpoint intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("two_nodes")]  # one cluster, one worker

LORA = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """What tests/two_node_runs.py reports: each check's result (or its error) and the node ids."""
    work = tmp_path_factory.mktemp("two_nodes")
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="rn", dir="/tmp") as ray_tmp:  # (short: Ray's socket paths)
        env = {**os.environ, "PYTHONPATH": str(root), "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp}
        run = subprocess.run(
            [sys.executable, "-m", "tests.two_node_runs", str(work / "report.json")],
            capture_output=True,
            text=True,
            env=env,
            timeout=540,
            cwd=root,
        )
    assert (work / "report.json").is_file(), run.stderr[-3000:]
    report = json.loads((work / "report.json").read_text())
    assert run.returncode == 0, run.stderr[-3000:]
    return report


def part(nodes, name: str) -> dict:
    got = nodes.get(name, {"error": "not reached"})
    assert "error" not in got, got["error"]
    return got


def lora(run_dir: str, *sub: str) -> dict:
    return load_file(Path(run_dir, *sub, LORA))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_shard_and_sp_groups_never_straddle_a_node(nodes):
    got = part(nodes, "placement")
    assert max(got["old"]) == 2  # the setup discriminates: one PACK group splits a pair across nodes
    assert got["new"] == [1, 1]  # each pair on one node
    assert got["strategies"] == ["STRICT_PACK", "STRICT_PACK", "PACK"]


def test_a_run_across_two_nodes_equals_the_same_run_on_one(nodes):
    """The rollout worker on one node, the trainer rank on another (weights and samples cross
    between raylets), against both on one node: the same rewards every iteration and the same final
    LoRA weights, bit for bit."""
    one, two, ids = part(nodes, "one"), part(nodes, "two"), nodes["nodes"]
    assert {n for row in one["nodes"].values() for n in row.values()} == {ids["one"]}
    assert ids["rollout"] != ids["trainer"]
    assert all(
        row == {"pool:rollout": ids["rollout"], "pool:trainer": ids["trainer"]}
        for row in two["nodes"].values()
    )
    assert [r["reward_mean"] for r in two["rows"]] == [r["reward_mean"] for r in one["rows"]]
    assert_same(lora(two["run_dir"], "final"), lora(one["run_dir"], "final"))


def test_the_trainer_node_replaced_mid_run_loses_and_repeats_nothing(nodes):
    """The trainer's node removed (killed) after iteration 0 and a fresh node added: the run restarts
    every worker from the iteration-1 checkpoint on the new node and finishes; every (iteration,
    group) generated once and trained once (the timeline as recorded), the one-node result bit for bit."""
    from digenrl.config.run import load_config
    from digenrl.engine.timeline import Timeline
    from tests.helpers import assert_timeline_invariants
    from tests.two_node_runs import RESTARTS, SETS

    got, one, ids = part(nodes, "replaced"), part(nodes, "one"), nodes["nodes"]
    assert got["nodes"]["0"]["pool:trainer"] == ids["trainer"]
    assert got["nodes"]["1"]["pool:trainer"] == ids["fresh"] != ids["trainer"]
    assert [r["iteration"] for r in got["rows"]] == [0, 1]
    assert [r["samples"] for r in got["rows"]] == [r["samples"] for r in one["rows"]]
    cfg = load_config(None, SETS + RESTARTS)
    assert_timeline_invariants(cfg, Timeline.from_chrome_trace(Path(got["run_dir"]) / "timeline.json"))
    assert [r["reward_mean"] for r in got["rows"]] == [r["reward_mean"] for r in one["rows"]]
    assert_same(lora(got["run_dir"], "final"), lora(one["run_dir"], "final"))


def test_a_node_lost_for_good_stops_the_run_with_one_line(nodes):
    """``digenrl train`` with ``engine.trainer_restarts=1``; the trainer's node killed in iteration 1
    and none added: the restart finds no node for the trainer pool. One line naming the lost node and
    what it held, exit code 2, no traceback; the iteration-1 checkpoint as written (the one-node
    run's, bit for bit) and the hint to resume."""
    from digenrl.checkpoint.store import list_checkpoints

    got, one, ids = part(nodes, "lost"), part(nodes, "one"), nodes["nodes"]
    assert got["code"] == 2, got["stderr"][-2000:]
    assert "Traceback" not in got["stderr"]
    last = got["stderr"].strip().splitlines()[-1]
    run = got["run_dir"]
    assert last.startswith(f"error: node {ids['fresh'][:12]} (with trainer0) left the Ray cluster: "), last
    assert "trainer rank trainer0 died while running train-1-0-0" in last
    assert "the run stopped: cluster: cannot place " in last and "pool:trainer 1 needed, 0 exist" in last
    hint = (
        f"last checkpoint: {run}/checkpoints/iter-000001 (iteration 1); resume with: digenrl train --resume"
    )
    assert last.endswith(f"{hint} {run}")
    assert [p.name for p in list_checkpoints(Path(run))] == ["iter-000001"]
    assert_same(lora(run, "checkpoints", "iter-000001"), lora(one["run_dir"], "checkpoints", "iter-000001"))


def test_node_groups_merge_overlapping_groups(tiny_cfg):
    """HSDP of four trainer ranks (two shard groups of two), each shard group one SP pair: the same
    pairs come from both, merged once each (a node per pair), in worker order; no rollout worker."""
    from digenrl.placement.resolve import resolve

    layout = resolve(
        tiny_cfg(
            "placement.mode=disaggregated",
            "engine.tag=false",
            "train.fsdp=2",
            "engine.trainer_sp=2",
            "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 4}]",
        )
    )
    assert layout.shard_groups and layout.trainer_sp_groups
    t = layout.trainer_ranks
    assert [tuple(g) for g in layout.shard_groups] == [tuple(g) for g in layout.trainer_sp_groups]
    assert layout.node_groups == [(t[0], t[1]), (t[2], t[3])]
