"""Soak: the engine for many iterations with rollout workers killed at random, then the books.

    python benchmarks/soak.py [--iterations 40] [--fault-rate 0.15] [--seed 0] [--rollout-workers 2]
                              [--reward-service] [--no-tag] [--json soak.json] [--run-dir DIR]

Every rollout unit of the run is, with probability ``--fault-rate``, marked to kill the rollout
worker that runs it, or with ``--reward-service`` half the time the reward actor scoring it
(``engine.faults``: the process exits mid-unit, as a crash would). Ray restarts it and the engine
generates the unit again whole. The run uses all engine features
(GAP, TSP 2, TAG, one-step async); with TAG an idle trainer rank may take a unit marked to fault,
which then fires nowhere (a trainer is spared), so ``restarts`` can be below ``units_with_a_fault``;
``--no-tag`` makes every marked unit run on a rollout worker (one restart each).
Afterwards the run directory's timeline is audited:

    iterations   iterations completed (metrics rows)
    restarts     worker restarts (the engine's count; each injected fault that fired is one)
    lost         (iteration, group, TSP share) that were never trained            -- must be 0
    duplicated   (iteration, group, TSP share) trained more than once              -- must be 0
    rollouts_generated_again   rollout units run twice because a worker died with its results
    longest_stall_s the longest time in which no unit of work (rollout, train, step) ended anywhere:
                 bounds the wait after any fault (a broken group that leaves a worker waiting
                 shows here; 849bed7: 300 s, then the run stopped)

``--json FILE`` writes ``{"iterations": n, "restarts": n, "lost": n, "duplicated": n, ...}``.
Not a test: it takes minutes, and its numbers go into the closing note of the reliability work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from digenrl.config.run import load_config  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402

TINY = [
    "model.height=16",
    "model.width=16",
    "train.prompts_per_iteration=4",
    "algorithm.group_size=4",
    "sampling.steps=4",
    "output.save_samples_every=0",
    "output.tensorboard=false",
    "output.checkpoint_every=10",
    "train.device=cpu",
    "placement.mode=disaggregated",
    "engine.unit_groups=1",
    "engine.gap=true",
    "engine.tsp_degree=2",
    "engine.tag=true",
    "engine.max_staleness=1",
]


def fault_list(
    iterations: int, units: int, workers: int, rate: float, seed: int, reward_service: bool
) -> list[tuple[str, str]]:
    """(worker, unit) pairs: each rollout unit, with probability ``rate``, kills whichever rollout
    worker runs it (a TAG trainer rank that takes it is spared: a trainer death ends the run), or
    with the reward service, half the time, the reward actor while it scores the unit."""
    rng = random.Random(seed)
    out = []
    for k in range(iterations):
        for j in range(units):
            if rng.random() >= rate:
                continue
            unit = f"rollout-{k}-{j}"
            if reward_service and rng.random() < 0.5:
                out.append(("reward", unit))
            else:
                out += [(f"rollout{i}", unit) for i in range(workers)]
    return out


def audit(run_dir: Path, iterations: int, groups: int, degree: int) -> dict:
    spans = [
        e for e in json.loads((run_dir / "timeline.json").read_text())["traceEvents"] if e.get("ph") == "X"
    ]
    events = [e["args"] for e in spans]
    trained = Counter(
        (a["iteration"], g, a["tsp_rank"]) for a in events if a["kind"] == "train" for g in a["groups"]
    )
    expected = {(k, g, r) for k in range(iterations) for g in range(groups) for r in range(degree)}
    rolled = Counter(a["unit"] for a in events if a["kind"] == "rollout")
    work = sorted(e["ts"] + e["dur"] for e in spans if e["args"]["kind"] in ("rollout", "train", "step"))
    return {
        "lost": sum(1 for key in expected if trained[key] == 0),
        "duplicated": sum(n - 1 for n in trained.values() if n > 1)
        + sum(1 for key in trained if key not in expected),
        "rollouts_generated_again": sum(
            n - 1 for n in rolled.values() if n > 1
        ),  # results lost with a worker
        "longest_stall_s": round(max((b - a for a, b in zip(work, work[1:])), default=0.0) / 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--fault-rate", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rollout-workers", type=int, default=2)
    ap.add_argument("--reward-service", action="store_true", help="score in a reward actor (killed too)")
    ap.add_argument("--tag", action=argparse.BooleanOptionalAction, default=True, help="engine.tag")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--run-dir", type=Path)
    args = ap.parse_args()

    probe = load_config(None, TINY)
    units = probe.train.prompts_per_iteration // probe.engine.unit_groups
    faults = fault_list(
        args.iterations, units, args.rollout_workers, args.fault_rate, args.seed, args.reward_service
    )
    service = ["reward.service={num_cpus: 0.1}"] if args.reward_service else []
    pools = f"cluster.pools=[{{name: rollout, count: {args.rollout_workers}}}, {{name: trainer, count: 1}}]"
    spec = ", ".join(f"{{worker: {w}, unit: {u}}}" for w, u in faults)
    cfg = load_config(
        None,
        TINY
        + service
        + [
            pools,
            f"train.iterations={args.iterations}",
            f"train.seed={args.seed}",
            f"engine.faults=[{spec}]",
            f"engine.max_restarts={len(faults) + 1}",
            f"engine.tag={str(args.tag).lower()}",
        ],
    )
    # (a unit with a fault kills its rollout worker each time one runs it; a TAG trainer spares it)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="digenrl-soak-"))
    print(
        f"soak: {args.iterations} iterations, faults planned on {len({u for _, u in faults})} of "
        f"{args.iterations * units} rollout units, run directory {run_dir}",
        file=sys.stderr,
    )
    t0 = time.time()
    result = run_engine(cfg, run_dir)
    wall = time.time() - t0
    books = audit(result.run_dir, args.iterations, cfg.train.prompts_per_iteration, cfg.engine.tsp_degree)
    out = {
        "iterations": len(result.metrics),
        "restarts": result.metrics[-1]["worker_restarts"] if result.metrics else 0,
        "lost": books["lost"],
        "duplicated": books["duplicated"],
        "units_with_a_fault": len({u for _, u in faults}),
        "rollouts_generated_again": books["rollouts_generated_again"],
        "longest_stall_s": books["longest_stall_s"],
        "wall_s": round(wall, 1),
        "samples_per_s": round(sum(r["samples"] for r in result.metrics) / wall, 2),
    }
    width = max(map(len, out))
    for key, value in out.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if out["lost"] or out["duplicated"] or out["iterations"] != args.iterations:
        sys.exit(1)


if __name__ == "__main__":
    main()
