"""Multi-node placement for real, on one machine (issue 36, item 12): a Ray cluster of two nodes on
localhost (``ray.cluster_utils.Cluster``). A shard group or a sequence-parallel group runs collectives
every forward, so it must live on one node: the engine reserves one STRICT_PACK placement group per
such group (``RunLayout.node_groups``) and packs the other workers. The check runs in a subprocess
(its own Ray, beside the suite's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from digenrl.engine.resources import reserve_by_node

    # two nodes of 3 devices each; six workers of one device: two pairs that must share a node (PACK
    # fills the head first: w0-w2 there, w3-w5 on the other node, so w2 and w3 would straddle)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"dev": 3}})
    cluster.add_node(num_cpus=1, resources={"dev": 3})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    workers = [SimpleNamespace(name=f"w{i}") for i in range(6)]
    bundles = [{"dev": 1} for _ in workers]
    node_groups = [("w2", "w3"), ("w4", "w5")]

    def nodes(group, indices):
        where = placement_group_table(group)["bundles_to_node_id"]
        return sorted({where[i] for i in indices})

    # 849bed7's arrangement: one PACK group of every bundle (fills the head first): does a pair straddle?
    packed = placement_group(bundles, strategy="PACK")
    ray.get(packed.ready(), timeout=60)
    old = [len(nodes(packed, [int(n[1:]) for n in g])) for g in node_groups]
    remove_placement_group(packed)

    groups, slots = reserve_by_node(bundles, workers, node_groups)
    new = [len({placement_group_table(slots[int(n[1:])][0])["bundles_to_node_id"][slots[int(n[1:])][1]]
                for n in g}) for g in node_groups]
    strategies = [placement_group_table(g)["strategy"] for g in groups]
    print(json.dumps({"old": old, "new": new, "strategies": strategies, "nodes": len(ray.nodes())}))
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_shard_and_sp_groups_never_straddle_a_node(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["nodes"] == 2
    assert max(got["old"]) == 2  # the setup discriminates: one PACK group splits a pair across nodes
    assert got["new"] == [1, 1]  # each pair on one node
    assert got["strategies"] == ["STRICT_PACK", "STRICT_PACK", "PACK"]


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
