"""What an elastic-TAG decision (``engine.tag: auto``, BTS) costs at 32 workers, beside what it decides.

    python benchmarks/bts_cost.py [--config configs/flux1_dev.yaml] [--iterations 4] [--depth 1]
        [--cluster configs/clusters/16xH100_16xL40S.yaml] [--json FILE]

The planner's simulator (analytic cost model, no profile) runs FLUX.1-dev on 16xH100 + 16xL40S,
disaggregated 16 + 16 both ways round (1 prompt group per rollout unit: 32 units per iteration),
with TAG off, on and auto. For auto every decision is timed on this host (wall clock of the
search, which plays both branches forward through the driver loop); the table gives the simulated
iteration time per mode, the decisions, and their cost beside the iteration they steer. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from digenrl.config.engine import PoolConfig
from digenrl.config.run import load_config
from digenrl.placement.plan import Plan
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import load_cluster
from digenrl.planner.simulator import Simulator
from digenrl.planner.workload import Workload
from digenrl.schedule.bts import Elastic

ROOT = Path(__file__).resolve().parents[1]


def timed_run(plan: Plan, cost: CostModel, iterations: int, depth: int) -> tuple[float, list, Simulator]:
    """(steady iteration seconds, per-decision wall seconds, the simulator)."""
    sim = Simulator(plan, cost, iterations)
    spent: list[float] = []
    el = sim.sched.elastic
    if el is not None:
        el.depth = depth
        search = el.insert

        def insert(sched, worker):
            t0 = time.perf_counter()
            try:
                return search(sched, worker)
            finally:
                spent.append(time.perf_counter() - t0)

        el.insert = insert
    timeline = sim.run()
    stats = timeline.iteration_stats()[1:-1] or timeline.iteration_stats()
    return statistics.mean(r["wall_s"] for r in stats), spent, sim


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/flux1_dev.yaml")
    ap.add_argument("--cluster", default="configs/clusters/16xH100_16xL40S.yaml")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    cfg = load_config(ROOT / args.config, ["engine.unit_groups=1"])
    cluster = load_cluster(ROOT / args.cluster)
    rows = []
    cost = CostModel(Workload.from_config(cfg), cluster)
    pools = {p.name: p for p in cluster.pools}
    print(
        f"{'rollout -> trainer':<20} {'tag':>5} {'iteration s':>12} {'decisions':>9} {'inserted':>8} "
        f"{'ms/decision':>11} {'max ms':>7} {'decide s/iter':>13}"
    )
    for r, t in (("l40s", "h100"), ("h100", "l40s")):
        for tag in (False, True, "auto"):
            plan = Plan(
                placement="disaggregated",
                pools=(PoolConfig(**pools[r].model_dump()), PoolConfig(**pools[t].model_dump())),
                unit_groups=1,
                tag=tag,
                gap=True,
                tsp_degree=1,
            )
            it, spent, sim = timed_run(plan, cost, args.iterations, args.depth)
            el: Elastic | None = sim.sched.elastic
            row = {"rollout": r, "trainer": t, "tag": tag, "iteration_s": it, "decisions": len(spent)}
            line = f"{r + ' -> ' + t:<20} {str(tag):>5} {it:12.2f}"
            if el is not None:
                row["inserted"] = sum(d.insert for d in el.decisions)
                row["ms_per_decision"] = 1e3 * statistics.mean(spent) if spent else 0.0
                row["max_ms"] = 1e3 * max(spent, default=0.0)
                row["decide_s_per_iteration"] = sum(spent) / args.iterations
                line += (
                    f" {len(spent):9d} {row['inserted']:8d} {row['ms_per_decision']:11.2f} "
                    f"{row['max_ms']:7.1f} {row['decide_s_per_iteration']:13.3f}"
                )
            print(line)
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
