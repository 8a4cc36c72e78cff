"""The engine calibration run: a short run of the engine itself (disaggregated, sync, 1 + 1 CPU
workers) and what its timeline shows -- the dispatch gap before a unit, the samples transfer, the
publish / fetch times as the runtime pays them, how much slower a unit runs in an engine worker
than in the profile (``unit_time_factor``) and the unit-to-unit spread (``unit_cv``)."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from digenrl.config.run import validate_config
from digenrl.engine.timeline import Timeline
from digenrl.planner.constants import CALIBRATION_ITERATIONS


def engine_run_overheads(cfg, m: dict, run_engine, iterations: int = CALIBRATION_ITERATIONS) -> dict:
    """Run the engine itself (disaggregated, GAP/TSP/TAG off, 1 rollout + 1 trainer CPU worker) and
    read from its timeline what it pays around the units: the dispatch gap before a unit (median),
    the extra before a train unit that waits on another worker's samples, publish and fetch times;
    how much longer a unit takes in an engine worker than the profile's own whole unit
    (``unit_time_factor``), and the unit-to-unit spread inside the workers (``unit_cv``).
    ``run_engine``: :func:`digenrl.launch.run_engine` (the caller's: the planner imports no launcher)."""

    data = cfg.model_dump(mode="json")
    data["cluster"] = {
        "pools": [
            {"name": "rollout", "device": "cpu", "count": 1},
            {"name": "trainer", "device": "cpu", "count": 1},
        ]
    }
    data["placement"] = {"mode": "disaggregated", "rollout_pool": "rollout", "trainer_pool": "trainer"}
    data["engine"] = {**data["engine"], "gap": False, "tag": False, "tsp_degree": 1, "max_staleness": 0}
    data["train"] = {**data["train"], "iterations": iterations, "device": "cpu"}
    data["output"] = {**data["output"], "save_samples_every": 0, "checkpoint_every": 0, "eval_every": 0}
    cal = validate_config(data)
    with tempfile.TemporaryDirectory() as tmp:
        result = run_engine(cal, Path(tmp) / "run")
        tl = Timeline.from_chrome_trace(Path(tmp) / "run" / "timeline.json")
    out = timeline_overheads(tl, m)
    out["unit_time_factor"] = unit_time_factors(tl, cal, m)
    out["unit_cv"] = timeline_unit_cv(tl)
    out["calibration_rows"] = [
        {k: r[k] for k in ("iteration", "wall_s", "samples_per_s", "bubble_fraction")} for r in result.metrics
    ]
    return out


def unit_time_factors(tl, cfg, m: dict, reference: dict[str, float] | None = None) -> dict:
    """How much longer units take inside the engine's worker processes than in the profile (Ray's
    worker process and its threads, samples read from the object store, the driver and the other
    worker beside them): mean engine unit time, over the iterations after the first, / the
    ``reference`` unit time, per unit kind -- by default the profile's composed unit, which at the
    profiled unit size is its round-robin whole unit: the very estimate the cost model scales (a
    factor taken against another estimate of the same unit would scale the wrong one)."""
    from digenrl.planner.call_times import ProfiledTimes, rollout_unit_time, train_unit_time
    from digenrl.planner.workload import Workload

    if reference is None:
        w = Workload.from_config(cfg)
        times = ProfiledTimes({"device": {"name": "profile"}, "measurements": m})
        groups = cfg.engine.unit_groups
        reference = {
            "rollout": rollout_unit_time(times, w, groups, w.rollout_batch)[0],
            "train": train_unit_time(times, w, groups, 0, 1, cfg.train.micro_batch),
        }
    out = {}
    for kind, pred in reference.items():
        got = [e.duration for e in tl.events if e.kind == kind and e.iteration > 0]
        if got and pred > 0:
            out[kind] = statistics.fmean(got) / pred
    return out


def unit_spread(series: list[list[float]]) -> float:
    """Coefficient of variation of unit durations from successive differences (von Neumann):
    ``sqrt(mean((x[i+1] - x[i])^2) / 2) / mean(x)`` within each series (one worker's units, or one
    item's timing rounds, in time order). What two workers' units differ by at a barrier is their
    unit-to-unit jitter; a slow drift of the host's speed, which both see alike, does not count."""
    diffs = [(b - a) ** 2 for xs in series for a, b in zip(xs, xs[1:])]
    values = [x for xs in series for x in xs]
    if not diffs or not values:
        return 0.0
    return (statistics.fmean(diffs) / 2) ** 0.5 / statistics.fmean(values)


def timeline_unit_cv(tl) -> dict[str, float]:
    """:func:`unit_spread` of a run's rollout and train units, each worker's in time order, after
    the first (warm-up) iteration."""
    events = sorted(tl.events, key=lambda e: e.start)
    return {
        kind: unit_spread(
            [
                [e.duration for e in events if e.kind == kind and e.worker == w and e.iteration > 0]
                for w in tl.workers
            ]
        )
        for kind in ("rollout", "train")
    }


def timeline_overheads(tl, m: dict) -> dict:
    main = sorted(
        (
            e
            for e in tl.events
            if e.kind in ("rollout", "train", "step")
            or (e.kind == "sync" and e.args.get("direction") == "fetch")
        ),
        key=lambda e: e.start,
    )
    calls, transfers = [], []
    last_on: dict[str, object] = {}
    for e in main:
        before = [f for f in main if f.end <= e.start + 1e-9 and f is not e]
        prev = last_on.get(e.worker)
        last_on[e.worker] = e
        if not before or (prev is not None and prev.kind == "sync"):
            continue  # the run's first unit, or a rollout right after its own weight fetch
        trigger = max(before, key=lambda f: f.end)
        gap = e.start - trigger.end
        if e.kind == "train" and trigger.kind == "rollout" and trigger.worker != e.worker:
            transfers.append(gap)
        else:
            calls.append(gap)
    call_s = statistics.median(calls) if calls else 0.0
    fetch = [e.duration for e in tl.events if e.kind == "sync" and e.args.get("direction") == "fetch"]
    publish = [e.duration for e in tl.events if e.kind == "sync" and e.args.get("direction") == "publish"]
    ws = m["weight_sync"]
    out = {"call_s": call_s, "source": "engine calibration run (timeline gaps)", "gaps": len(calls)}
    if transfers:
        out["transfer_latency_s"] = max(0.0, statistics.median(transfers) - call_s)
    if fetch:
        out["get_s"] = max(0.0, statistics.median(fetch) - ws["load_s"])
    if publish:
        out["put_s"] = max(0.0, statistics.median(publish) - ws["pack_s"])
    return out
