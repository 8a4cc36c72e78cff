"""Scoring off the critical path: the same engine run with rewards inline and with ``reward.service``.

    python benchmarks/reward_overlap.py [--iterations 6] [--repeats 1] [--clip-size 192] [--clip-layers 4]
                                        [--set KEY=VALUE ...] [--json FILE] [--keep DIR]

A local Ray cluster with 1 rollout + 1 trainer logical device (GAP, on-policy); the reward is
CLIPScore on a random CLIP built here (no download) whose size sets how long scoring takes.
Inline, the rollout worker scores each unit itself before its next unit; with the service it
submits the decoded samples to the reward actor and generates its next unit at once.

Reported per mode: samples/s over the whole run and in the steady state (first and last
iteration left out), the mean reward latency per unit, and (service) the fraction of the
reward actor's busy time that overlapped the generation of another rollout unit. With
``--repeats N`` the modes alternate (inline, service, inline, ...) and the median run of each
mode (by samples/s) is reported beside every run's samples/s.
Not a test: timings are reported, never asserted. On a 2-core machine the reward actor's
thread competes with the two devices' threads, so the gain is smaller than on real hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_worker_niceness", "0")  # as engine_modes.py: equal footing on a shared machine

BASE = [
    "model.height=16",
    "model.width=16",
    "algorithm.group_size=4",
    "sampling.steps=4",
    "train.prompts_per_iteration=4",
    "placement.mode=disaggregated",
    "engine.gap=true",
    "engine.tsp_degree=2",
    "engine.tag=false",
    "engine.max_staleness=0",
]


def overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    """Seconds of ``a`` covered by the union of ``spans``."""
    cut = sorted((max(s, a[0]), min(e, a[1])) for s, e in spans if e > a[0] and s < a[1])
    total, cur = 0.0, a[0]
    for s, e in cut:
        s = max(s, cur)
        if e > s:
            total += e - s
            cur = e
    return total


def measure(run_dir: Path) -> dict:
    from digenrl.engine.timeline import Timeline
    from digenrl.run.rundir import read_metrics

    tl = Timeline.from_chrome_trace(run_dir / "timeline.json")
    rows = read_metrics(run_dir)
    rollouts, rewards = tl.of("rollout"), tl.of("reward")
    busy = sum(w.duration for w in rewards)
    covered = sum(
        overlap((w.start, w.end), [(r.start, r.end) for r in rollouts if r.uid != w.uid]) for w in rewards
    )
    whole, steady = tl.summary(), tl.summary(skip=1, tail=1)
    return {
        "samples_per_s": whole["samples_per_s"],
        "steady_samples_per_s": steady["samples_per_s"],
        "wall_s": whole["wall_s"],
        "reward_busy_s": busy,
        "reward_overlapped_generation": covered / busy if busy else 0.0,
        "reward_latency_s": sum(r["reward_latency_s"] for r in rows) / len(rows),
        "reward_queue_depth": max(r.get("reward_queue_depth", 0) for r in rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--clip-size", type=int, default=192, help="image side of the random CLIP (slower when larger)"
    )
    p.add_argument("--clip-layers", type=int, default=4)
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="after the above"
    )
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--keep", type=Path, help="keep the two run directories here (timeline.json, metrics.jsonl)"
    )
    args = p.parse_args()

    import ray
    import torch

    from digenrl.engine.resources import start_local

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_model_rewards import make_tiny_clip

    from digenrl.config.run import load_config
    from digenrl.launch import run_engine

    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {"inline": [], "service": []}
    with tempfile.TemporaryDirectory() as tmp:
        clip = make_tiny_clip(
            Path(tmp) / "clip", image_size=args.clip_size, hidden=64, layers=args.clip_layers
        )
        reward = [
            f"reward.components=[{{name: clipscore, args: {{path: {clip}}}}}]",
            f"train.iterations={args.iterations}",
        ]
        started = start_local({"pool:rollout": 1, "pool:trainer": 1}, num_cpus=2, log_to_driver=False)
        try:
            for i in range(args.repeats):
                for mode, extra in {"inline": [], "service": ["reward.service={num_cpus: 0.1}"]}.items():
                    run_dir = (args.keep or Path(tmp)) / f"{mode}-{i}"
                    run_engine(load_config(None, BASE + reward + extra + args.overrides), run_dir=run_dir)
                    runs[mode].append(measure(run_dir))
                    print(
                        mode, i, json.dumps({k: round(v, 4) for k, v in runs[mode][-1].items()}), flush=True
                    )
        finally:
            if started:
                ray.shutdown()
    out = {}
    for mode, mine in runs.items():
        ranked = sorted(mine, key=lambda r: r["samples_per_s"])
        out[mode] = {**ranked[len(ranked) // 2], "all_samples_per_s": [r["samples_per_s"] for r in mine]}
    speedup = out["service"]["samples_per_s"] / out["inline"]["samples_per_s"]
    print(
        f"service / inline samples/s: {speedup:.2f}x; reward busy time overlapping generation: "
        f"{out['service']['reward_overlapped_generation']:.0%}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
