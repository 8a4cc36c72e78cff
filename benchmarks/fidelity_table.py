"""benchmarks/plan_fidelity.py's arithmetic and printing: the replay cost model (the simulator fed the
run's own unit times), one run's row, the medians per mode, the table."""

from __future__ import annotations

import os
import statistics


def replay_cost(cost, measured):
    """The same cost model, but every unit takes what it took in the measured run (mean per kind and
    TSP rank, and the run's unit-to-unit spread), and no CPU sharing on top (measured durations
    include it): what the simulator predicts when the unit times are right, i.e. the error of the
    scheduling + overhead model alone."""
    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.measure.engine_run import timeline_unit_cv

    by = {}
    for e in measured.events:
        if (e.kind == "sync" and e.args.get("direction") != "fetch") or e.iteration == 0:
            continue  # iteration 0 warms up (and is not in the measured steady state)
        by.setdefault((e.kind, e.args.get("tsp_rank", 0)), []).append(e.duration)
    med = {k: statistics.mean(v) for k, v in by.items()}  # throughput: the mean, not the median
    steps = {}
    for e in measured.events:
        if e.kind == "step":
            steps.setdefault(e.uid.split("/")[0], []).append(e.duration)
    step_s = statistics.median(min(v) for v in steps.values())  # the last rank's share: no waiting
    # rank 0's publish inside its step (over the broadcast the rollout workers' prefetch spans it)
    published = [
        e.duration for e in measured.events if e.kind == "sync" and e.args.get("direction") == "publish"
    ]
    publish_s = min(statistics.mean(published), step_s) if published else 0.0
    spread = timeline_unit_cv(measured)

    class Replay(CostModel):
        def rollout_unit(self, device, groups, setup=None):
            return med[("rollout", 0)], med.get(("reward", 0), 0.0)

        def train_unit(self, device, groups, tsp_rank, tsp_degree, setup=None):
            return med.get(("train", tsp_rank), med[("train", 0)])

        def step(self, device, ranks, publish, setup=None):
            return step_s, publish_s if publish else 0.0

        def sync_fetch(self, device):
            return med.get(("sync", 0), 0.0)

        def cpu_rate(self, busy):
            return 1.0

        def unit_cv(self, device, kind):
            return spread[kind]

    return Replay(cost.workload, cost.cluster, cost.params, profile=cost.profile)


def unit_ms(predicted, measured) -> dict:
    """Mean duration (ms) per unit kind (train per TSP rank) after the first iteration: predicted,
    measured."""

    def means(tl):
        by = {}
        for e in tl.events:
            if e.iteration > 0 and e.kind in ("rollout", "train", "step"):
                by.setdefault(
                    e.kind + (str(e.args.get("tsp_rank", 0)) if e.kind == "train" else ""), []
                ).append(e.duration * 1e3)
        return {k: statistics.mean(v) for k, v in by.items()}

    p, m = means(predicted), means(measured)
    return {k: (p[k], m.get(k, float("nan"))) for k in sorted(p)}


def fmt(d) -> str:
    return "{" + ", ".join(f"{k}: {v:.2f}" for k, v in d.items()) + "}" if d else "-"


def rel(predicted: float, measured: float) -> float:
    """The relative error of a prediction."""
    return (predicted - measured) / measured


def run_row(mode, rep, pred, meas, at_load, replay, load, profile, run_s: float, units: dict) -> dict:
    """One run's row: the prediction, the measurement (steady-state summaries), the prediction at the
    run's measured load and the replay's, the other processes' load, the run's seconds, the unit
    means (:func:`unit_ms`), the profile's factors."""
    m, engine = profile["measurements"], profile["engine"] or {}
    return {
        "mode": mode,
        "repeat": rep,
        "predicted_samples_per_s": pred["samples_per_s"],
        "measured_samples_per_s": meas["samples_per_s"],
        "rel_error": rel(pred["samples_per_s"], meas["samples_per_s"]),
        "predicted_bubble_fraction": pred["bubble_fraction"],
        "measured_bubble_fraction": meas["bubble_fraction"],
        "predicted_iteration_s": pred["iteration_s"],
        "measured_iteration_s": meas["iteration_s"],
        "at_run_load_samples_per_s": at_load["samples_per_s"],
        "at_run_load_rel_error": rel(at_load["samples_per_s"], meas["samples_per_s"]),
        "replay_samples_per_s": replay["samples_per_s"],
        "replay_rel_error": rel(replay["samples_per_s"], meas["samples_per_s"]),
        "other_load_cores": load.other_cores,
        "other_runnable": load.other_runnable,
        "profile_other_runnable": m.get("other_runnable"),
        "run_s": run_s,
        "unit_ms": units,
        "profile_other_load_cores": m.get("other_load_cores"),
        "profile_unit_factors": [m["unit_overhead"].get(k) for k in ("rollout_factor", "train_factor")],
        "engine_unit_factor": engine.get("unit_time_factor"),
        "unit_cv": engine.get("unit_cv"),
        "cpu_slowdown": m.get("cpu_slowdown"),
    }


def print_run(r: dict, cores: bool) -> None:
    print(
        f"{r['mode']:12s} #{r['repeat'] + 1} predicted {r['predicted_samples_per_s']:7.2f} samples/s  "
        f"measured {r['measured_samples_per_s']:7.2f}  error {r['rel_error']:+6.1%}   bubble "
        f"predicted {r['predicted_bubble_fraction']:.2f} measured "
        f"{r['measured_bubble_fraction']:.2f}   replay error {r['replay_rel_error']:+6.1%}\n    "
        f"other processes: {r['other_runnable']:.1f} runnable threads, "
        f"{r['other_load_cores']:.2f} cores (profiled beside "
        f"{r['profile_other_runnable'] or 0:.1f}, {r['profile_other_load_cores'] or 0:.2f})"
        + (
            f"; at the run's load predicted {r['at_run_load_samples_per_s']:.2f}, error "
            f"{r['at_run_load_rel_error']:+.1%}"
            if cores
            else ""
        )
        + "\n    unit ms predicted / measured: "
        + ", ".join(f"{k} {p:.0f}/{m:.0f}" for k, (p, m) in r["unit_ms"].items()),
        flush=True,
    )


MEDIANS = (
    "predicted_bubble_fraction",
    "measured_bubble_fraction",
    "replay_rel_error",
    "at_run_load_samples_per_s",
    "other_load_cores",
    "other_runnable",
)


def mode_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """Per mode, in order: the median prediction against the median measurement (and the medians of
    the rest), with every run's row under ``runs``."""
    rows = []
    for mode, rs in runs.items():
        pred = statistics.median(r["predicted_samples_per_s"] for r in rs)
        meas = statistics.median(r["measured_samples_per_s"] for r in rs)
        row = {"mode": mode, "predicted_samples_per_s": pred, "measured_samples_per_s": meas}
        row["rel_error"] = rel(pred, meas)
        row |= {k: statistics.median(r[k] for r in rs) for k in MEDIANS}
        row["at_run_load_rel_error"] = rel(row["at_run_load_samples_per_s"], meas)
        rows.append({**row, "runs": rs})
    return rows


def print_table(rows: list[dict], repeats: int, cores: bool) -> None:
    """``cores``: the prediction depends on the other processes' load directly (``--cpu-sharing
    cores``): the prediction at the run's load gets a column."""
    print()
    print(
        f"{'mode':12s} {'pred. samples/s':>16s} {'meas. samples/s':>16s} {'rel. error':>10s} "
        f"{'pred. bubble':>12s} {'meas. bubble':>12s}"
        + (f" {'at run load':>11s}" if cores else "")
        + f" {'replay error':>12s} {'other cores':>11s}"
    )
    for r in rows:
        print(
            f"{r['mode']:12s} {r['predicted_samples_per_s']:16.2f} {r['measured_samples_per_s']:16.2f} "
            f"{r['rel_error']:+10.1%} {r['predicted_bubble_fraction']:12.2f} "
            f"{r['measured_bubble_fraction']:12.2f}"
            + (f" {r['at_run_load_rel_error']:+11.1%}" if cores else "")
            + f" {r['replay_rel_error']:+12.1%} {r['other_load_cores']:11.2f}"
        )
    worst = max(abs(r["rel_error"]) for r in rows)
    print(
        f"{'median of ' + str(repeats) + ' runs per mode; ' if repeats > 1 else ''}worst |error| "
        f"{worst:.1%} (target 10%); other cores = CPU other processes used during the runs (of "
        f"{os.cpu_count()} cores)"
        + (
            "; at run load = the prediction beside the other processes' runnable "
            "threads measured during the run"
            if cores
            else ""
        )
    )
