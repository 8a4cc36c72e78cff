"""Mini-batch PPO on the tiny FLUX demo: reward gain with ``train.optimizer_steps`` S vs 1.

    python benchmarks/minibatch_ppo.py [--steps 1 4] [--seeds 0 1 2] [--iterations 20] [--lr 1e-2]
                                       [--set KEY=VALUE ...] [--json FILE]

The default demo (``configs/flux_tiny.yaml``: 32x32, G = 8, 4 prompts per iteration, 8 SDE
steps, the ``prompt_color`` reward) with the local trainer (``placement.mode: local``), for every
S and seed; ``--set`` overrides more (a smaller image, fewer steps: a cheaper run). Reported per S, mean and
standard error over the seeds:

- the reward gain at equal iterations: the mean training reward of the last 3 iterations minus
  that of iteration 0 (which every S shares: same seed, same initial weights);
- the reward gain at equal time: the same, over the 3 last iterations each run finished within
  the shortest run's time -- measured both as wall time and as the CPU time of this process
  (on a shared machine the wall time of the same work varies with other users' load; the CPU
  time does much less, and on one device it is what wall time measures);
- clip_frac and ratio_min / ratio_max (mean over iterations), and seconds per iteration.

Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

TAIL = 3  # iterations averaged at the end of a run


def run(steps: int, seed: int, iterations: int, lr: float, run_dir: Path, overrides: list[str]) -> dict:
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer

    cfg = load_config(
        None,
        [
            "placement.mode=local",
            f"train.iterations={iterations}",
            f"train.seed={seed}",
            f"train.lr={lr}",
            f"train.optimizer_steps={steps}",
            "output.save_samples_every=0",
            "output.checkpoint_every=0",
            "output.tensorboard=false",
            *overrides,
        ],
    )
    t0, c0, rows = time.perf_counter(), time.process_time(), []
    LocalTrainer(cfg).run(
        run_dir,
        on_iteration=lambda r: rows.append(
            {**r, "t": time.perf_counter() - t0, "cpu": time.process_time() - c0}
        ),
    )
    return {
        "steps": steps,
        "seed": seed,
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
    }


def upto(rows: list[dict], key: str, limit: float) -> list[dict]:
    """The rows logged by ``limit`` (wall or CPU seconds), and always the first."""
    return [row for row in rows if row[key] <= limit + 1e-9] or rows[:1]


def gain(rows: list[dict]) -> float:
    return statistics.fmean(r["reward_mean"] for r in rows[-TAIL:]) - rows[0]["reward_mean"]


def mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:  # interleaved, so load on the shared machine hits every S alike
            for s in args.steps:
                runs.append(
                    run(s, seed, args.iterations, args.lr, Path(tmp) / f"s{s}-seed{seed}", args.overrides)
                )
                r = runs[-1]
                print(
                    f"S={s} seed={seed}: gain {gain(r['rows']):+.4f} in {r['wall_s']:.0f} s wall, "
                    f"{r['cpu_s']:.0f} s CPU",
                    flush=True,
                )
    wall = min(r["rows"][-1]["t"] for r in runs)  # the shortest run's time
    cpu = min(r["rows"][-1]["cpu"] for r in runs)
    print(
        f"\n{len(args.seeds)} seeds, {args.iterations} iterations, lr {args.lr} {' '.join(args.overrides)}; "
        f"equal time = {wall:.0f} s wall, {cpu:.0f} s CPU"
    )
    print(
        "S | gain @ equal iterations | @ equal wall time | @ equal CPU time | clip_frac | ratio_min | "
        "ratio_max | CPU s/iteration"
    )
    summary = {}
    for s in args.steps:
        mine = [r for r in runs if r["steps"] == s]
        g_it = mean_se([gain(r["rows"]) for r in mine])
        # at least the first row: under load one run's first iteration can outlast another's whole run
        g_wall = mean_se([gain(upto(r["rows"], "t", wall)) for r in mine])
        g_cpu = mean_se([gain(upto(r["rows"], "cpu", cpu)) for r in mine])
        clip = statistics.fmean(row["clip_frac"] for r in mine for row in r["rows"])
        rmin = statistics.fmean(row["ratio_min"] for r in mine for row in r["rows"])
        rmax = statistics.fmean(row["ratio_max"] for r in mine for row in r["rows"])
        per_it = statistics.fmean(r["cpu_s"] / args.iterations for r in mine)
        summary[s] = {
            "gain_iterations": g_it,
            "gain_wall": g_wall,
            "gain_cpu": g_cpu,
            "clip_frac": clip,
            "ratio_min": rmin,
            "ratio_max": rmax,
            "cpu_s_per_iteration": per_it,
            "iterations_within_cpu": [sum(row["cpu"] <= cpu + 1e-9 for row in r["rows"]) for r in mine],
        }
        print(
            f"{s} | {g_it[0]:+.4f} ± {g_it[1]:.4f} | {g_wall[0]:+.4f} ± {g_wall[1]:.4f} | "
            f"{g_cpu[0]:+.4f} ± {g_cpu[1]:.4f} | {clip:.3f} | {rmin:.5f} | {rmax:.5f} | {per_it:.2f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "summary": summary, "runs": runs},
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
