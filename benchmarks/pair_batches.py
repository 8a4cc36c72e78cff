"""The planner's prediction with and without timestep-pair train batches (``train.pair_batch``).

    python benchmarks/pair_batches.py [--cluster configs/clusters/16xH800.yaml] [--only TEXT] [--json FILE]

Per workload (FLUX.1-dev and Wan2.1-T2V-14B as configured, and FLUX.1-dev with DanceGRPO-style
random trained steps), two searches of the same cluster: per-step forwards only, and with pair
batches among the knobs (``pair_times.pair_sizes``). A row gives each best plan and the ratio of
their samples/s, with its range over the cost model's distinct leave-one-out fits (each fit
re-ranks the top plans of both searches: ``uncertainty.distinct_fits``). Predictions, not
measurements; not a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from digenrl.config.run import load_config
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import load_cluster
from digenrl.planner.pair_times import pair_sizes
from digenrl.planner.search import candidates, search, sp_degrees
from digenrl.planner.uncertainty import distinct_fits, params_under
from digenrl.planner.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
RANDOM = ["algorithm.timesteps.mode=random", "algorithm.timesteps.fraction=0.5"]
WORKLOADS = (
    ("FLUX.1-dev", "flux1_dev.yaml", []),
    ("FLUX.1-dev, random steps (half)", "flux1_dev.yaml", RANDOM),
    ("Wan2.1-T2V-14B 480p", "wan2.1_t2v_14b.yaml", []),
)


def best_pair(cost: CostModel, cluster, pairs: tuple, top: int = 5):
    plans = candidates(
        cluster,
        cost.workload.prompts,
        group_size=cost.workload.group_size,
        sp=sp_degrees(cost, cluster),
        pairs=pairs,
    )
    return search(cost, cluster, top=top, plans=plans)


def row(name: str, config: str, sets: list[str], cluster) -> dict:
    w = Workload.from_config(load_config(ROOT / "configs" / config, sets))
    cost = CostModel(w, cluster)
    off, on = best_pair(cost, cluster, (None,)), best_pair(cost, cluster, pair_sizes(w))
    ratios = []
    for theta in distinct_fits():
        c = CostModel(w, cluster, params_under(theta, cost.params), cost.colocation, cost.overheads)
        sps = [
            search(c, cluster, top=1, plans=[r.plan for r in res.ranked[:5]]).ranked[0].samples_per_s
            for res in (off, on)
        ]
        ratios.append(sps[1] / sps[0])
    a, b = off.ranked[0], on.ranked[0]
    return {
        "workload": name,
        "per_step": {"plan": a.plan.label(), "samples_per_s": a.samples_per_s},
        "pairs": {"plan": b.plan.label(), "samples_per_s": b.samples_per_s},
        "ratio": b.samples_per_s / a.samples_per_s,
        "loo_range": (min(ratios), max(ratios)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default=str(ROOT / "configs/clusters/16xH800.yaml"))
    ap.add_argument("--only", default="", help="the workloads whose name holds this text")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    rows = [row(*w, cluster) for w in WORKLOADS if args.only in w[0]]
    print(
        f"| workload ({cluster.name}) | per-step forwards: best plan, samples/s "
        "| pair batches allowed | ratio (LOO) |"
    )
    print("|---|---|---|---|")
    for r in rows:
        lo, hi = r["loo_range"]
        a, b = r["per_step"], r["pairs"]
        print(
            f"| {r['workload']} | {a['plan']}: {a['samples_per_s']:.3g} "
            f"| {b['plan']}: {b['samples_per_s']:.3g} "
            f"| {r['ratio']:.2f}x ({lo:.2f}..{hi:.2f}) |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
