"""Throughput of every engine mode on the same hardware, beside the bound of DESIGN.md §4.

    python benchmarks/engine_modes.py [--iterations 7] [--repeats 1] [--pick best|median]
        [--workload balanced|flow_grpo|few_groups|colocated_batch|kl_reference|tag_balanced|
                    tag_flow_grpo|all]
                                      [--modes colocated,sync,...] [--json FILE] [--tiny]

One local Ray cluster with 1 rollout + 1 trainer logical device (each actor one torch thread:
the fair split of a 2-core machine); colocated runs 2 "both" workers on the same 2 devices.
Modes: colocated, sync (disaggregated, no GAP/TAG), gap, gap_tsp (TSP 2), gap_tsp_tag,
full (all of them + max_staleness 1). Every number is the steady state: the first iteration
(warm-up) and the last (nothing left to overlap with) are left out.

Bound per iteration, with R and T the measured rollout and train (+ step) device-seconds per
iteration and r, t the device counts: colocated (R+T)/(r+t); disaggregated without TAG
max(R/r, T/t); with TAG max(T/t, (R+T)/(r+t)). Efficiency = bound / measured iteration time.
Workloads: "balanced" tunes the trained-timestep fraction so that training costs about what
rollout costs; "flow_grpo" is the default Flow-GRPO setting (fraction 0.99: 7 of 8 steps trained,
training 2-3x rollout). "few_groups" (not part of "all") has fewer groups than rollout devices: 1 group
of 16 samples per iteration on 2 rollout + 1 trainer devices (GAP, no TAG, on-policy), its modes
"whole_groups" (the group is one unit: one rollout device idles) and "sub_groups"
(engine.unit_samples=8: each rollout device generates half the group), run side by side.
"colocated_batch" (not part of "all"): colocated, units of 16 samples, train micro-batch 2; modes
"trainer_batches" (sampling forwards of 2, the trainer's) and "unit_batch" (engine.colocated_batch 16:
one forward of the unit), side by side; "vs the first mode" is the feature's speed-up.
"kl_reference" (not part of "all"): Flow-GRPO with a KL term (kl_beta 0.04, 7 of 8 steps trained),
disaggregated with GAP on 1 + 1 devices; modes "train" (the reference forward in the train unit) and
"rollout" (algorithm.kl_reference rollout: computed by the sampler, shipped with the samples), side by
side; the JSON's ``vs_first_mode_train_unit_s`` is the ratio of the train units' seconds per iteration
(each mode's median over the repeats).
"tag_balanced" / "tag_flow_grpo" (not part of "all"): the full mode with engine.tag off, on and auto
(elastic TAG, BTS: docs/architecture.md) on the balanced / Flow-GRPO workloads; the JSON's rows hold
``tag_units`` (rollout units a trainer rank generated).
Not a test: timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray starts workers at niceness 15; on a shared machine any other process then starves them
# (more so the modes that keep both devices busy). Equal footing measures the engine, not that.
os.environ.setdefault("RAY_worker_niceness", "0")

SIZE = [
    "model.height=48",
    "model.width=48",
    "sampling.steps=8",
    "algorithm.group_size=8",
    "train.prompts_per_iteration=8",
    "engine.unit_groups=2",
]  # 4 rollout units of 16 samples, ~170 ms each
#: --tiny: a smoke run of the code (the suite runs it), not a measurement
TINY = [
    "model.height=16",
    "model.width=16",
    "sampling.steps=3",
    "algorithm.group_size=4",
    "train.prompts_per_iteration=2",
    "engine.unit_groups=1",
]
WORKLOADS = {
    "balanced": SIZE + ["algorithm.timesteps.fraction=0.5"],  # 4 of 8 steps trained: T ~ R
    "flow_grpo": SIZE + ["algorithm.timesteps.fraction=0.99"],  # 7 of 8 steps trained: T ~ 3R
}
FEW_GROUPS = [
    "model.height=48",
    "model.width=48",
    "sampling.steps=8",
    "algorithm.group_size=16",
    "train.prompts_per_iteration=1",
    "engine.unit_groups=1",
    "algorithm.timesteps.fraction=0.5",
    "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
]
#: colocated workers sampling in the trainer's micro-batches (2) vs a whole unit (16) per forward
#: (engine.colocated_batch), the same run otherwise
COLOCATED_BATCH = SIZE + ["algorithm.timesteps.fraction=0.5", "train.micro_batch=2"]
DEVICES = {"few_groups": (2, 1)}  # (rollout, trainer) devices; the other workloads 1 + 1
DISAGG = ["placement.mode=disaggregated", "engine.max_staleness=0"]
MODES = {
    # every knob explicit (DISAGG pins max_staleness 0): no mode depends on the defaults (colocated)
    "colocated": [
        "placement.mode=colocated",
        "engine.gap=false",
        "engine.tag=false",
        "engine.tsp_degree=1",
        "engine.max_staleness=0",
    ],
    "sync": DISAGG + ["engine.gap=false", "engine.tag=false", "engine.tsp_degree=1"],
    "gap": DISAGG + ["engine.gap=true", "engine.tag=false", "engine.tsp_degree=1"],
    "gap_tsp": DISAGG + ["engine.gap=true", "engine.tag=false", "engine.tsp_degree=2"],
    "gap_tsp_tag": DISAGG + ["engine.gap=true", "engine.tag=true", "engine.tsp_degree=2"],
    "full": [
        "placement.mode=disaggregated",
        "engine.gap=true",
        "engine.tag=true",
        "engine.tsp_degree=2",
        "engine.max_staleness=1",
    ],
}
FEW_GROUP_MODES = {
    "whole_groups": DISAGG + ["engine.gap=true", "engine.tag=false", "engine.tsp_degree=1"],
    "sub_groups": DISAGG
    + ["engine.gap=true", "engine.tag=false", "engine.tsp_degree=1", "engine.unit_samples=8"],
}
COLOCATED_BATCH_MODES = {
    "trainer_batches": MODES["colocated"] + ["engine.colocated_batch=trainer"],
    "unit_batch": MODES["colocated"] + ["engine.colocated_batch=16"],
}
#: the KL reference's forward in the train unit vs at rollout (algorithm.kl_reference), the same run
KL_REFERENCE = SIZE + ["algorithm.timesteps.fraction=0.99", "algorithm.kl_beta=0.04"]
KL_REFERENCE_MODES = {
    "train": MODES["gap"] + ["algorithm.kl_reference=train"],
    "rollout": MODES["gap"] + ["algorithm.kl_reference=rollout"],
}
#: elastic TAG (engine.tag auto, BTS) against greedy TAG (on) and none, in the full mode otherwise
TAG_MODES = {
    f"full_tag_{v}": [o if o != "engine.tag=true" else f"engine.tag={v}" for o in MODES["full"]]
    for v in ("off", "on", "auto")
}
WORKLOADS["tag_balanced"] = WORKLOADS["balanced"]
WORKLOADS["tag_flow_grpo"] = WORKLOADS["flow_grpo"]  # the trainer is the bottleneck: greedy TAG hurts
WORKLOADS["few_groups"] = FEW_GROUPS
WORKLOADS["colocated_batch"] = COLOCATED_BATCH
WORKLOADS["kl_reference"] = KL_REFERENCE
MODES_OF = {
    "few_groups": FEW_GROUP_MODES,
    "colocated_batch": COLOCATED_BATCH_MODES,
    "kl_reference": KL_REFERENCE_MODES,
    "tag_balanced": TAG_MODES,
    "tag_flow_grpo": TAG_MODES,
}  # else: MODES


def bound(mode_cfg, R: float, T: float, r: int, t: int) -> float:
    if mode_cfg.placement.mode == "colocated":
        return (R + T) / (r + t)
    if mode_cfg.engine.tag:
        return max(T / t, (R + T) / (r + t))
    return max(R / r, T / t)


def run_mode(workload: str, mode: str, iterations: int, root: Path, extra: list[str] = ()) -> dict:
    from digenrl.config.run import load_config
    from digenrl.engine.timeline import Timeline
    from digenrl.launch import run_engine

    cfg = load_config(
        None,
        WORKLOADS[workload]
        + MODES_OF.get(workload, MODES)[mode]
        + [*extra, f"train.iterations={iterations}"],
    )
    started = time.perf_counter()
    result = run_engine(cfg, run_dir=root / f"{workload}-{mode}")
    total = time.perf_counter() - started
    tl = Timeline.from_chrome_trace(result.run_dir / "timeline.json")
    s = tl.summary(skip=1, tail=1)  # steady state: iteration 0 warms up, the last one drains
    R, T = s["rollout_device_s"], s["train_device_s"]
    r, t = DEVICES.get(workload, (1, 1))
    b = bound(cfg, R, T, r=r, t=t)  # colocated: the same 2 devices, r + t = 2
    last = max(e.iteration for e in tl.of("rollout"))
    steady = [e for e in tl.of("train") if 0 < e.iteration < last] or tl.of("train")
    iterations = len({e.iteration for e in steady})
    return {
        "mode": mode,
        "samples_per_s": s["samples_per_s"],
        "bubble_fraction": s["bubble_fraction"],
        "sync_s": s["sync_s"],
        "iteration_s": s["iteration_s"],
        "R_device_s": R,
        "T_device_s": T,
        "bound_s": b,
        "efficiency": b / s["iteration_s"],
        "wall_s_with_startup": total,
        # train units' seconds per steady iteration (T_device_s without the optimizer steps)
        "train_unit_s": sum(e.duration for e in steady) / iterations,
        # KL reference forwards each side ran (the timeline's ref_forwards; 0 without a KL term)
        "ref_forwards_rollout": sum(e.args.get("ref_forwards", 0) for e in tl.of("rollout")),
        "ref_forwards_train": sum(e.args.get("ref_forwards", 0) for e in tl.of("train")),
        "tag_units": sum(tl.workers[e.worker] == "trainer" for e in tl.of("rollout")),
    }


def pick_run(runs: list[dict], how: str) -> dict:
    """The best (least disturbed by other processes) or the median run by throughput; whole rows
    stay consistent, and every run's throughput is kept beside it."""
    ordered = sorted(runs, key=lambda r: r["samples_per_s"])
    row = dict(ordered[-1] if how == "best" else ordered[len(ordered) // 2])
    row["samples_per_s_all"] = [r["samples_per_s"] for r in runs]
    row["train_unit_s_all"] = [r["train_unit_s"] for r in runs]
    row["train_unit_s_median"] = sorted(row["train_unit_s_all"])[len(runs) // 2]
    return row


def table(title: str, rows: list[dict]):
    from rich.table import Table

    by = {r["mode"]: r for r in rows}
    tab = Table(title=title)
    for col in (
        "mode",
        "samples/s",
        "vs colocated",
        "vs the first mode",
        "bubble",
        "sync s/iter",
        "iter s",
        "train units s/iter",
        "R dev-s",
        "T dev-s",
        "bound s",
        "efficiency",
    ):
        tab.add_column(col, justify="right" if col != "mode" else "left")
    for r in rows:

        def ratio(ref: str) -> str:
            return f"{r['samples_per_s'] / by[ref]['samples_per_s']:.2f}x" if ref in by else "-"

        tab.add_row(
            r["mode"],
            f"{r['samples_per_s']:.1f}",
            ratio("colocated"),
            ratio(rows[0]["mode"]),
            f"{r['bubble_fraction']:.1%}",
            f"{r['sync_s'] * 1e3:.1f} ms",
            f"{r['iteration_s']:.3f}",
            f"{r['train_unit_s_median']:.3f}",
            f"{r['R_device_s']:.3f}",
            f"{r['T_device_s']:.3f}",
            f"{r['bound_s']:.3f}",
            f"{r['efficiency']:.2f}",
        )
    return tab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--iterations", type=int, default=7, help="per mode; the first and last are not measured"
    )
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument(
        "--modes", default=None, help="comma-separated subset (default: every mode of the workload)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, in round robin")
    parser.add_argument(
        "--pick",
        choices=["best", "median"],
        default="best",
        help="which run of the repeats to report (best: least disturbed by other load)",
    )
    parser.add_argument("--json", type=Path, help="write the measured numbers here")
    parser.add_argument("--tiny", action="store_true", help="a 16x16, 3-step smoke run of the code")
    args = parser.parse_args(argv)
    extra = TINY if args.tiny else []

    import ray
    from rich.console import Console

    from digenrl.engine.resources import start_local

    console = Console(width=170)
    own = ("few_groups", "colocated_batch", "kl_reference", "tag_balanced", "tag_flow_grpo")  # when named
    workloads = [w for w in WORKLOADS if w not in own] if args.workload == "all" else [args.workload]
    modes_of = {}
    for workload in workloads:
        known = MODES_OF.get(workload, MODES)
        modes_of[workload] = [m for m in (args.modes.split(",") if args.modes else known) if m]
        if unknown := [m for m in modes_of[workload] if m not in known]:
            print(
                f"error: --modes: {', '.join(unknown)} not a mode of workload {workload} "
                f"({', '.join(known)})",
                file=sys.stderr,
            )
            return 2
    started = start_local({"pool:rollout": 2, "pool:trainer": 1}, log_to_driver=False)
    results: dict[str, list[dict]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for workload in workloads:
                modes = modes_of[workload]
                runs: dict[str, list[dict]] = {m: [] for m in modes}
                for rep in range(args.repeats):  # round robin: background load drifts, modes share it
                    for mode in modes:
                        console.print(f"[dim]{workload} / {mode} ({rep + 1}/{args.repeats}) ...[/dim]")
                        runs[mode].append(
                            run_mode(workload, mode, args.iterations, Path(tmp) / str(rep), extra)
                        )
                rows = results[workload] = [pick_run(runs[m], args.pick) for m in modes]
                load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
                r, t = DEVICES.get(workload, (1, 1))
                console.print(
                    table(
                        f"engine modes - {workload} workload ({r} rollout + {t} trainer device(s), "
                        f"{os.cpu_count()} CPU cores, {args.pick} of {args.repeats}, load average {load})",
                        rows,
                    )
                )
    finally:
        if started:
            ray.shutdown()
    if args.json:
        first = results[workloads[0]]
        ratios = {
            w: {r["mode"]: r["samples_per_s"] / rows[0]["samples_per_s"] for r in rows}
            for w, rows in results.items()
        }
        unit_ratios = {
            w: {r["mode"]: r["train_unit_s_median"] / rows[0]["train_unit_s_median"] for r in rows}
            for w, rows in results.items()
        }
        out = {
            "modes": first,
            "workloads": results,
            "vs_first_mode": ratios,
            "vs_first_mode_train_unit_s": unit_ratios,
        }
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
