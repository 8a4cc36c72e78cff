"""Warm workers: a sequence of engine runs in one process, each starting fresh actors ("cold") vs
inside ``tests.warm.warm_workers()`` ("warm": each run builds its workers in the
processes the previous runs kept, by kind, the same worker name first).

    python benchmarks/warm_workers.py [--repeats 3] [--runs sync,fsdp2,rollout_sp,sync] [--json F]

The runs are tiny engine runs of the shapes the test suite runs (2 iterations, 16x16, 4 steps):

    sync        disaggregated, 1 rollout worker + 1 trainer rank
    fsdp2       1 rollout worker + 2 trainer ranks sharded together (FSDP2)
    rollout_sp  2 rollout workers as one sequence-parallel group + 1 trainer rank
    tsp2        1 rollout worker + 2 replicated trainer ranks, time-step parallel

Each pass runs the whole sequence cold, then warm (a fresh pool), alternating ``--repeats`` times
in this one process, and reports per run the median wall seconds and how many of its actors were
reused / started warm. ``--json FILE`` writes ``{"runs": [{"run", "cold_s", "warm_s", "reused",
"started"}], "total_cold_s", "total_warm_s", "repeats"}``. Not a test: timings are reported, never
asserted; run it on a quiet machine and say its load with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from digenrl.config.run import load_config  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from tests import warm  # noqa: E402

TINY = [
    "model.height=16",
    "model.width=16",
    "train.prompts_per_iteration=2",
    "algorithm.group_size=4",
    "sampling.steps=4",
    "train.iterations=2",
    "output.save_samples_every=0",
    "output.tensorboard=false",
    "train.device=cpu",
    "placement.mode=disaggregated",
    "engine.gap=false",
    "engine.tag=false",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
]
RUNS = {
    "sync": ["cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]"],
    "fsdp2": ["train.fsdp=2", "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]"],
    "rollout_sp": [
        "engine.rollout_sp=2",
        "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
    ],
    "tsp2": [
        "engine.tsp_degree=2",
        "train.fsdp=off",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
    ],
}


def one_pass(names: list[str], pool: warm.WarmPool | None) -> list[dict]:
    rows = []
    for name in names:
        reused, started = (pool.reused, pool.started) if pool else (0, 0)
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            run_engine(load_config(None, TINY + RUNS[name]), run_dir=Path(tmp) / "run")
            seconds = time.perf_counter() - t
        row = {"run": name, "seconds": seconds}
        if pool is not None:
            row.update(reused=pool.reused - reused, started=pool.started - started)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--runs", default="sync,fsdp2,rollout_sp,tsp2,sync", help="comma-separated: " + ", ".join(RUNS)
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"error: --runs: unknown {unknown} (choose from {', '.join(RUNS)})")
    import ray

    cpus = min(2, os.cpu_count() or 1)
    ray.init(
        address="local",
        num_cpus=cpus,
        resources={"pool:rollout": 2, "pool:trainer": 2},
        include_dashboard=False,
    )
    cold, hot = [], []
    try:
        for _ in range(args.repeats):
            cold.append(one_pass(names, None))
            with warm.warm_workers() as pool:
                hot.append(one_pass(names, pool))
    finally:
        ray.shutdown()
    runs = []
    for i, name in enumerate(names):
        runs.append(
            {
                "run": name,
                "cold_s": statistics.median(p[i]["seconds"] for p in cold),
                "warm_s": statistics.median(p[i]["seconds"] for p in hot),
                "reused": hot[-1][i]["reused"],
                "started": hot[-1][i]["started"],
            }
        )
    total_cold = statistics.median(sum(r["seconds"] for r in p) for p in cold)
    total_warm = statistics.median(sum(r["seconds"] for r in p) for p in hot)
    print(f"{'run':<12}{'cold s':>9}{'warm s':>9}{'reused':>8}{'started':>9}")
    for r in runs:
        print(f"{r['run']:<12}{r['cold_s']:>9.1f}{r['warm_s']:>9.1f}{r['reused']:>8}{r['started']:>9}")
    print(
        f"{'sequence':<12}{total_cold:>9.1f}{total_warm:>9.1f}   "
        f"({total_cold / total_warm:.2f}x), medians of {args.repeats}"
    )
    if args.json:
        out = {"runs": runs, "total_cold_s": total_cold, "total_warm_s": total_warm, "repeats": args.repeats}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
