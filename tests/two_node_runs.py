"""The engine on a Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), for
tests/test_two_nodes.py: ``RAY_TMPDIR=D python -m tests.two_node_runs OUT.json`` (the cluster's address file
in D, where no other process's ``ray.init()`` finds it). One cluster serves every check,
each writing its part of OUT.json as it ends (a check that fails leaves its error there):

- ``placement``: shard / SP groups never straddle a node (two nodes with 3 logical devices each);
- ``one`` / ``two``: the same disaggregated run with both pools on one node, then with the rollout
  pool on the head and the trainer pool on a second node;
- ``replaced``: the trainer's node removed after iteration 0 and a fresh one added
  (``engine.trainer_restarts=1``);
- ``lost``: ``digenrl train`` whose trainer node is removed in iteration 1, none added.

Nodes ask for no CPU: a worker's bundle is its pool's logical device alone, so placement follows the
pools and the actors share this machine's cores as in the suite's other engine runs."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
import time
import traceback
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from digenrl.config.run import load_config
from digenrl.launch import run_engine
from tests.helpers import QUIET, TINY, as_sets

#: Ray notices a lost node in ~1 s instead of ~15 s (its health check's period and misses)
FAST_HEALTH = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 2,
    "health_check_timeout_ms": 1000,
    "health_check_initial_delay_ms": 0,
}
SETS = [
    *TINY,
    *QUIET,
    "placement.mode=disaggregated",
    "engine.tag=false",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
    "train.iterations=2",
    "output.checkpoint_every=1",
]
RESTARTS = ["engine.trainer_restarts=1"]


def pool_nodes() -> dict[str, str]:
    """Where the running run's workers are: pool resource -> node id (from the placement groups)."""
    where = {}
    for g in placement_group_table().values():
        if g["state"] != "CREATED":
            continue
        for i, bundle in g["bundles"].items():
            for key in bundle:
                if key.startswith("pool:"):
                    where[key] = g["bundles_to_node_id"][i]
    return where


def placement_check() -> dict:
    """Two pairs of one-device workers that must share a node, over two nodes of 3 devices each:
    one PACK group of every bundle splits a pair; ``reserve_by_node`` never does."""
    from types import SimpleNamespace

    from digenrl.engine.resources import reserve_by_node

    out = {}
    workers = [SimpleNamespace(name=f"w{i}") for i in range(6)]
    bundles = [{"dev": 1} for _ in workers]
    node_groups = [("w2", "w3"), ("w4", "w5")]

    def spread(group, slots):
        return len({placement_group_table(group)["bundles_to_node_id"][i] for i in slots})

    packed = placement_group(bundles, strategy="PACK")
    ray.get(packed.ready(), timeout=60)
    out["old"] = [spread(packed, [int(n[1:]) for n in g]) for g in node_groups]
    remove_placement_group(packed)
    groups, slots = reserve_by_node(bundles, workers, node_groups)
    out["new"] = [
        len(
            {
                placement_group_table(slots[int(n[1:])][0])["bundles_to_node_id"][slots[int(n[1:])][1]]
                for n in g
            }
        )
        for g in node_groups
    ]
    out["strategies"] = [placement_group_table(g)["strategy"] for g in groups]
    for g in groups:
        remove_placement_group(g)
    return out


def engine_run(cluster, name: str, sets: list[str], on_iteration=None) -> dict:
    run_dir = WORK / name
    seen = {}

    def each(row):
        seen[row["iteration"]] = pool_nodes()
        if on_iteration is not None:
            on_iteration(row)

    result = run_engine(load_config(None, sets), run_dir, each, ray_address=cluster.address)
    return {"run_dir": str(run_dir), "rows": result.metrics, "nodes": seen}


def cli_run(cluster, name: str, sets: list[str], after_row0) -> dict:
    """``digenrl train`` in this process (stderr captured); ``after_row0()`` runs in a thread once
    iteration 0's row is on disk."""
    from digenrl.cli.app import main

    run_dir = WORK / name

    def watch():
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            time.sleep(0.1)
        after_row0()

    threading.Thread(target=watch, daemon=True).start()
    argv = ["digenrl", "train", "-q", "--run-dir", str(run_dir), "--ray-address", cluster.address]
    sys.argv, err, code = argv + as_sets(sets), io.StringIO(), None
    with contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as exc:
            code = exc.code
    return {"run_dir": str(run_dir), "code": code, "stderr": err.getvalue()}


def main(path: Path) -> None:
    report = {}

    def stage(name, fn, *args):
        t0 = time.time()
        try:
            report[name] = fn(*args)
        except BaseException:  # noqa: BLE001 -- recorded for the test to show
            report[name] = {"error": traceback.format_exc()[-3000:]}
        report[name]["wall_s"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(report, default=str))

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "resources": {"dev": 3}, "_system_config": FAST_HEALTH},
    )
    ray.init(address=cluster.address, log_to_driver=False)
    one_node = cluster.add_node(num_cpus=0, resources={"pool:rollout": 1, "pool:trainer": 1, "dev": 3})
    cluster.wait_for_nodes()
    nodes = report["nodes"] = {"one": one_node.node_id}
    stage("placement", placement_check)
    stage("one", engine_run, cluster, "one", SETS)
    cluster.remove_node(one_node)  # the rollout pool on one node, the trainer pool on another
    nodes["rollout"] = cluster.add_node(num_cpus=0, resources={"pool:rollout": 1}).node_id
    far = [cluster.add_node(num_cpus=0, resources={"pool:trainer": 1})]
    nodes["trainer"] = far[0].node_id
    cluster.wait_for_nodes()
    stage("two", engine_run, cluster, "two", SETS)

    def replace(row):
        if row["iteration"] == 0 and "fresh" not in nodes:
            cluster.remove_node(far[0], allow_graceful=False)
            far[0] = cluster.add_node(num_cpus=0, resources={"pool:trainer": 1})
            nodes["fresh"] = far[0].node_id

    stage("replaced", engine_run, cluster, "replaced", SETS + RESTARTS, replace)
    # the trainer blocks after iteration 1's train unit (alive, never answering): its node goes first
    block = "engine.faults=[{worker: trainer0, unit: 'train-1-0-0:block'}]"
    stage(
        "lost",
        cli_run,
        cluster,
        "lost",
        SETS + RESTARTS + [block],
        lambda: cluster.remove_node(far[0], False),
    )
    path.write_text(json.dumps(report, default=str))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    WORK = Path(sys.argv[1]).parent
    main(Path(sys.argv[1]))
