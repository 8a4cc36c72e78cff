"""How well does the planner predict the engine? Profile, predict every engine mode, run it, compare.

    python benchmarks/plan_fidelity.py [--config FILE] [--workload balanced|flow_grpo] [--iterations 6]
                                       [--repeats 3] [--reprofile] [--calibration run|ray]
                                       [--json fidelity.json] [--timelines DIR] [--tiny]

1. ``digenrl profile`` of the configured tiny model on this CPU (one thread per worker, as the engine
   runs), with the engine's own overheads measured either from a short calibration run of the engine
   (``run``: disaggregated sync, 1 + 1 workers, 8 iterations; the default) or from Ray micro-benchmarks
   only (``ray``: actor call round trip, object-store transfer);
2. for each mode (the knobs and workloads of benchmarks/engine_modes.py, 1 rollout + 1 trainer device):
     colocated    both devices roll out, then both train
     sync         disaggregated, gap false, tag false, tsp 1, staleness 0
     gap          + gap
     gap_tsp      + tsp 2
     gap_tsp_tag  + tag
     full         + max_staleness 1
     full_auto    full with tag auto (elastic TAG: the simulator runs the engine's BTS decision code)
   the simulator's prediction (the engine's Scheduler in virtual time with the profiled costs), then a
   real run of ``digenrl.launch.run_engine`` on a local Ray cluster;
3. samples/s and bubble fraction of both, over the same iterations (the first and the last left out),
   with the relative error of the prediction; and a "replay" prediction -- the simulator fed with the
   unit durations the run itself measured -- whose error is that of the scheduling and overhead model
   alone, without the profile's timing noise. ``--reprofile`` profiles (engine calibration included)
   right before each run instead of once (the host's speed drifts 10-20% within a minute: each run's
   profile then errs independently); ``--repeats N`` runs every mode N times in round robin and
   compares medians.

Timings on a shared machine are noisy (other processes take cores): rerun before trusting an outlier.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from digenrl.config.run import load_config  # noqa: E402

# The knobs of benchmarks/engine_modes.py (the engine's own benchmark), on the same hardware:
# 1 rollout + 1 trainer logical CPU device (colocated: the same 2 devices both roll out and train).
# the same workloads and mode definitions as benchmarks/engine_modes.py (one source of truth)
sys.path.insert(0, str(Path(__file__).parent))
from engine_modes import MODES, TAG_MODES, TINY, WORKLOADS  # noqa: E402
from fidelity_table import fmt, mode_rows, print_run, print_table, replay_cost, run_row, unit_ms  # noqa: E402

QUIET = ["output.save_samples_every=0", "output.checkpoint_every=0", "train.device=cpu"]
FIDELITY_MODES = {**MODES, "full_auto": TAG_MODES["full_tag_auto"]}


def mode_config(config, workload: str, mode: str, iterations: int, extra: list[str] = ()):
    overrides = (
        WORKLOADS[workload] + FIDELITY_MODES[mode] + [*extra, *QUIET, f"train.iterations={iterations}"]
    )
    return load_config(config, overrides)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=None, help="run config (default: the embedded tiny FLUX)")
    ap.add_argument(
        "--iterations", type=int, default=6, help="per run; the first and the last are not measured"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per mode, in round robin (background load drifts, modes share it); the table "
        "compares the median prediction with the median measurement",
    )
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="balanced")
    ap.add_argument("--calibration", choices=("run", "ray"), default="run")
    ap.add_argument("--modes", default=",".join(FIDELITY_MODES))
    ap.add_argument("--profile", type=Path, default=None, help="reuse a profile.json instead of profiling")
    ap.add_argument(
        "--cpu-sharing",
        choices=("cores", "measured"),
        default="measured",
        help="concurrent workers: the profile's measured slowdown of n concurrent workers (default), "
        "or processor sharing of the cores beside the other processes' runnable threads",
    )
    ap.add_argument(
        "--no-engine-unit-factor",
        dest="engine_unit_factor",
        action="store_false",
        help="do not scale units by the calibration run's engine/profile unit_time_factor",
    )
    ap.add_argument(
        "--reprofile",
        action="store_true",
        help="profile (engine calibration included) right before each run instead of once: the "
        "host's speed drifts, and each run's profile errs independently of the others",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the table as JSON")
    ap.add_argument(
        "--timelines", type=Path, default=None, help="keep predicted and measured timeline.json/png here"
    )
    ap.add_argument(
        "--tiny", action="store_true", help="a 16x16, 3-step smoke run of the code (short profile rounds)"
    )
    args = ap.parse_args(argv)
    extra = TINY if args.tiny else []
    if args.iterations < 3 or args.repeats < 1:
        ap.error("--iterations must be at least 3 (first and last are left out), --repeats at least 1")

    import ray
    import torch

    from digenrl.engine.resources import start_local
    from digenrl.engine.timeline import Timeline
    from digenrl.launch import run_engine
    from digenrl.placement.plan import Plan
    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.gpus import cluster_from_dict
    from digenrl.planner.measure.contention import OtherLoad
    from digenrl.planner.params import CostParams
    from digenrl.planner.profile import load_profile, run_profile, save_profile, unit_groups
    from digenrl.planner.sim_result import steady_summary
    from digenrl.planner.simulator import simulate
    from digenrl.planner.workload import Workload

    torch.set_num_threads(1)
    base = load_config(args.config, WORKLOADS[args.workload] + extra + QUIET)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in FIDELITY_MODES]:
        ap.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(FIDELITY_MODES)})")
    t0 = time.time()

    def profiled(what: str) -> dict:
        """One profile: ~17 timing rounds (the engine unit factor is taken against them)."""
        p = run_profile(
            base,
            "cpu",
            engine=args.calibration,
            run_engine=run_engine,
            sharing=2,
            batches=[unit_groups(base) * G],
            min_time=0.1 if args.tiny else 1.0,
            on_step=lambda s: print(f"  [{time.time() - t0:5.1f}s] {what}: {s}", flush=True),
        )
        describe(p)
        return p

    def describe(p: dict) -> None:
        eng, u = p["engine"] or {}, p["measurements"]["unit_overhead"]
        print(
            f"    profile: engine call {eng.get('call_s', 0) * 1e3:.1f} ms, transfer "
            f"{eng.get('transfer_latency_s', 0) * 1e3:.1f} ms ({eng.get('source')}); whole units "
            f"x{u.get('rollout_factor', 1):.2f} / x{u.get('train_factor', 1):.2f} their calls; "
            f"engine/profile unit time {fmt(eng.get('unit_time_factor'))} "
            f"({'applied' if args.engine_unit_factor else 'not applied'}); unit spread "
            f"{fmt(eng.get('unit_cv') or p['measurements'].get('unit_cv'))}; n concurrent workers "
            f"{fmt(p['measurements'].get('cpu_slowdown'))}",
            flush=True,
        )

    def predict(cfg, cost):
        """The simulator's run of ``cfg``'s plan under ``cost``."""
        plan, full = Plan.from_run_config(cfg), cfg.algorithm.std == "global"
        return simulate(plan, cost, args.iterations, wait_for_full_batch=full)

    G = base.algorithm.group_size
    profile = None
    if args.profile is not None:
        profile = load_profile(args.profile)
        describe(profile)
    elif not args.reprofile:
        profile = profiled("profile")
        save_profile(profile, Path(tempfile.gettempdir()) / "digenrl-fidelity-profile.json")
    params = CostParams(cpu_sharing=args.cpu_sharing, engine_unit_factor=args.engine_unit_factor)
    started = start_local({"pool:rollout": 1, "pool:trainer": 1})
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        workload = Workload.from_config(base)
        for rep in range(args.repeats):
            for mode in modes:
                cfg = mode_config(args.config, args.workload, mode, args.iterations, extra)
                if args.reprofile:  # the host's speed drifts 10-20% within a minute: each run gets its
                    profile = profiled(f"{mode} #{rep + 1} profile")  # own; errors average out over repeats
                cluster = cluster_from_dict(
                    {"name": "local_cpu", "pools": [p.model_dump() for p in cfg.cluster.pools]}
                )
                cost = CostModel(workload, cluster, params, profile=profile)
                sim = predict(cfg, cost)
                with tempfile.TemporaryDirectory() as tmp:
                    run_dir = Path(tmp) / mode
                    t1 = time.time()
                    with OtherLoad() as load:
                        run_engine(cfg, run_dir)
                    measured_tl = Timeline.from_chrome_trace(run_dir / "timeline.json")
                    if args.timelines is not None:
                        out = args.timelines / (mode if args.repeats == 1 else f"{mode}-{rep}")
                        sim.save(out / "predicted")
                        save_profile(profile, out / "profile.json")
                        (out / "measured").mkdir(parents=True, exist_ok=True)
                        measured_tl.save_json(out / "measured" / "timeline.json")
                        measured_tl.to_png(out / "measured" / "timeline.png")
                # the same prediction, but beside the other processes' load the run really had (their
                # runnable threads, measured during the run): what the planner would have said, had it
                # known what the other users of the host would do -- the load is an input, not a fit
                loaded = dataclasses.replace(params, cpu_other_load=load.other_runnable)
                at_load = predict(cfg, CostModel(workload, cluster, loaded, profile=profile)).summary
                replay = predict(cfg, replay_cost(cost, measured_tl)).summary
                r = run_row(
                    mode,
                    rep,
                    sim.summary,
                    steady_summary(measured_tl),
                    at_load,
                    replay,
                    load,
                    profile,
                    run_s=time.time() - t1,
                    units=unit_ms(sim.timeline, measured_tl),
                )
                runs[mode].append(r)
                print_run(r, args.cpu_sharing == "cores")
    finally:
        if started:
            ray.shutdown()

    rows = mode_rows(runs)
    print_table(rows, args.repeats, cores=args.cpu_sharing == "cores")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "modes": rows,
                    "profile_engine": profile["engine"] if profile else None,
                    "iterations": args.iterations,
                    "repeats": args.repeats,
                    "workload": args.workload,
                    "reprofile": args.reprofile,
                    "cpu_sharing": args.cpu_sharing,
                    "config": str(args.config or "embedded tiny FLUX"),
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
