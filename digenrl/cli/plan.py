"""``digenrl plan``: rank the placements of a cluster by simulated throughput; write the best as a config."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from digenrl.cli.tables import compact, say, show
from digenrl.config.run import RunConfig
from digenrl.errors import UserError
from digenrl.schedule.knobs import SchedulingKnobs, knob_values


def run_plan_command(
    cfg: RunConfig,
    cluster_path: Path | None,
    profile_path: Path | None,
    top: int,
    json_out: bool,
    write: Path | None,
    console: Console,
    iterations: int = 4,
    timeline_dir: Path | None = None,
    ladder: bool = False,
    show_peers: bool = False,
) -> dict:
    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.gpus import cluster_from_run_config, load_cluster
    from digenrl.planner.profile import load_profile
    from digenrl.planner.search import baselines, search
    from digenrl.planner.search import ladder as knob_ladder
    from digenrl.planner.workload import Workload

    if top < 1:
        raise UserError(f"--top: must be at least 1, got {top}")
    if iterations < 1:
        raise UserError(f"--iterations: must be at least 1, got {iterations}")
    if timeline_dir is not None and Path(timeline_dir).exists() and not Path(timeline_dir).is_dir():
        raise UserError(f"--timeline: {timeline_dir} exists and is not a directory")
    if cluster_path is not None:
        cluster = load_cluster(cluster_path)
    else:
        cluster = cluster_from_run_config(cfg)
    profile = load_profile(profile_path) if profile_path is not None else None
    if profile is not None:
        check_profile_device(profile, cluster)
    from digenrl.cli.liblog import library_output_beside

    status = console.status("reading the model shape...") if not json_out else _Quiet()
    beside = (
        Path(write).with_suffix(".log")
        if write is not None
        else Path(timeline_dir) / "log.txt"
        if timeline_dir is not None
        else None
    )
    with library_output_beside(console, lambda: beside, stderr=json_out), status:
        workload = Workload.from_config(cfg)
        cost = CostModel(workload, cluster, profile=profile)
        result = search(
            cost, cluster, top=top, iterations=iterations, wait_for_full_batch=cfg.algorithm.std == "global"
        )
        steps = (
            knob_ladder(cost, cluster, iterations, wait_for_full_batch=cfg.algorithm.std == "global")
            if ladder
            else []
        )
        peers = baselines(cost, cluster, iterations, wait_for_full_batch=cfg.algorithm.std == "global")
    report = plan_report(result, cost, cluster, top, steps, peers)
    if show_peers:  # the peers as they run (digenrl.planner.peers), beside the best plan
        from digenrl.cli.plan_peers import peers_report
        from digenrl.planner.search import peers as peer_runs

        report["peers"] = peers_report(result, cost, cluster, peer_runs(cost, cluster))
    if json_out:
        print(json.dumps(report, indent=2, default=str))
    else:
        say(console, plan_title(report))
        show(console, plan_table(report))
        if report["ladder"]:
            show(console, ladder_table(report))
        if report.get("peers"):
            from digenrl.cli.plan_peers import peers_notes, peers_table

            show(console, peers_table(report))
            for line in peers_notes(report):
                say(console, line)
        for line in report_notes(report):
            say(console, line)
    if timeline_dir is not None:
        best = result.ranked[0]
        best.save(Path(timeline_dir) / "best")
        if result.best_colocated is not None:
            result.best_colocated.save(Path(timeline_dir) / "colocated")
    if write is not None:
        path, layout_path = write_plan_config(cfg, result.ranked[0], cluster, write, report["plans"][0])
        if not json_out:
            console.print(f"wrote {path} (digenrl train -c {path}) and its layout {layout_path}")
    return report


def check_profile_device(profile: dict, cluster) -> None:
    """A profile calibrates the cost model of its own device type only: one of no device of the
    cluster would be silently unused."""
    key = str(profile["device"].get("table_key") or profile["device"].get("kind", ""))
    if key.lower() not in {d.lower() for d in cluster.devices}:
        raise UserError(
            f"--profile: measured on {key} ({profile['device'].get('name', '?')}), a device type "
            f"cluster {cluster.name} does not have ({cluster.describe()}); profile one of its devices"
        )


class _Quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------- report


def plan_row(r, result, rank: int | None = None) -> dict:
    sp = result.speedup(r)
    micro = trainer_micro_batch(r)
    notes = sorted({n for s in r.setups.values() for n in s.notes()})
    return {
        "rank": rank,
        "plan": r.plan.label(),
        "where": r.plan.where(),
        "knobs": r.plan.knobs(),
        "placement": r.plan.placement,
        "pools": [{**p.model_dump(mode="json"), "role": r.plan.role(p)} for p in r.plan.pools],
        "engine": knob_values(r.plan, SchedulingKnobs),  # group_parts > 1: engine.unit_samples = G / parts
        "micro_batch": micro,
        "samples_per_s": r.samples_per_s,
        "iteration_s": r.iteration_s,
        "bubble_fraction": r.bubble_fraction,
        "bound_s": r.bound_s,
        "efficiency": r.efficiency,
        "speedup_vs_colocated": sp,
        "notes": notes,
        "memory_gib": {name: round(s.need_bytes / 2**30, 2) for name, s in r.setups.items()},
    }


def plan_report(result, cost, cluster, top: int, steps=(), peers: dict | None = None) -> dict:
    rows = [plan_row(r, result, i + 1) for i, r in enumerate(result.ranked[:top])]
    sources = {d: cost.times(d).source for d in cluster.devices}
    return {
        "model": cost.workload.summary(),
        "cluster": {
            "name": cluster.name,
            "devices": cluster.devices,
            "gpus_per_node": cluster.gpus_per_node,
            "interconnect": cluster.interconnect.model_dump(),
        },
        "cost_model": {
            "times": sources,
            "params": asdict(cost.params),
            "colocation": asdict(cost.colocation),
            "engine_overheads": asdict(cost.overheads),
        },
        "search": {
            "candidates": result.candidates,
            "simulated": result.simulated,
            "rejected_by_memory": len(result.rejected),
            "seconds": result.seconds,
        },
        "best_colocated": plan_row(result.best_colocated, result) if result.best_colocated else None,
        # the peers' arrangements, each its best plan (search.BASELINES), and the best plan's speedup over
        # each: the engine runs every one of them, so the search held them too (never below 1)
        "baselines": {
            name: (
                {
                    **plan_row(r, result),
                    "best_speedup": result.ranked[0].samples_per_s / r.samples_per_s,
                }
                if r is not None and r.samples_per_s
                else None
            )
            for name, r in (peers or {}).items()
        },
        "plans": rows,
        "ladder": ladder_rows(steps, result),
    }


def ladder_rows(steps, result) -> list[dict]:
    """What each knob adds: per ladder step the best plan with the knobs so far, its gain over the
    previous step (``gain_vs_previous``) and over the best colocated plan."""
    rows, previous = [], None
    for name, r in steps:
        row = {"step": name, **(plan_row(r, result) if r else {"plan": None})}
        row["gain_vs_previous"] = r.samples_per_s / previous if r is not None and previous else None
        previous = r.samples_per_s if r is not None else previous
        rows.append(row)
    return rows


def _fmt_speedup(x) -> str:
    return f"{x:.2f}x" if x is not None else "n/a"


def plan_title(report: dict) -> str:
    m, c = report["model"], report["cluster"]
    return (
        f"{m['shape_source']} | {m['prompts']} prompts x {m['group_size']} samples, {m['steps']} steps "
        f"| cluster {c['name']} ({' + '.join(f'{n}x{d}' for d, n in c['devices'].items())})"
    )


def plan_table(report: dict) -> Table:
    m = report["model"]
    t = compact()  # its title: plan_title (a line of its own, never cut to the table's width)
    for col in ("#", "placement", "knobs"):
        t.add_column(col, overflow="fold")
    for col in ("samples/s", "s/iter", "bubble", "eff.", "vs col."):
        t.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    t.add_column("notes", overflow="fold")

    def add(row, label):
        notes = row["notes"] + (
            [f"mb {row['micro_batch']}"] if row["micro_batch"] not in (None, m["micro_batch"]) else []
        )
        t.add_row(
            label,
            row["where"],
            row["knobs"],
            f"{row['samples_per_s']:.4g}",
            f"{row['iteration_s']:.4g}",
            f"{row['bubble_fraction']:.0%}",
            f"{row['efficiency']:.2f}",
            _fmt_speedup(row["speedup_vs_colocated"]),
            ", ".join(notes),
        )

    for row in report["plans"]:
        add(row, str(row["rank"]))
    col = report["best_colocated"]
    if (
        not report.get("baselines")
        and col is not None
        and all(r["plan"] != col["plan"] for r in report["plans"])
    ):
        t.add_section()
        add(col, "col.")
    if report.get("baselines"):
        t.add_section()
        for name, row in report["baselines"].items():
            if row is None:
                t.add_row(name.replace("_", " "), "no plan fits", "", "", "", "", "", "", "")
            else:
                add(row, name.replace("_", " "))  # colocated whole groups: wraps at its words
    return t


def ladder_table(report: dict) -> Table:
    """GAP, TSP, TAG, async switched on one by one: the best plan at each step and what the step adds."""
    t = compact("what each knob adds (the best disaggregated plan with the knobs up to this line)")
    for col in ("step", "placement", "knobs"):
        t.add_column(col, overflow="fold")
    for col in ("samples/s", "bubble", "vs previous", "vs col."):
        t.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    for row in report["ladder"]:
        if not row.get("plan"):
            t.add_row(row["step"], "no plan fits", "", "", "", "", "")
            continue
        gain = row["gain_vs_previous"]
        t.add_row(
            row["step"],
            row["where"],
            row["knobs"],
            f"{row['samples_per_s']:.4g}",
            f"{row['bubble_fraction']:.0%}",
            f"{gain:.2f}x" if gain is not None else "-",
            _fmt_speedup(row["speedup_vs_colocated"]),
        )
    return t


def report_notes(report: dict) -> list[str]:
    s, cm = report["search"], report["cost_model"]
    lines = [
        "eff. = throughput bound (docs/architecture.md) / predicted iteration time; vs col. = speedup over "
        "the best colocated plan (sub-group units allowed)"
    ]
    if report.get("baselines"):
        lines.append(
            "baselines (OUR engine in the peers' arrangements, each its best plan, none of the peers' "
            "structural costs: `--peers` adds the peers as they run): colocated = samples spread over every "
            "device (veRL-Omni); colocated_whole_groups = units of whole groups only (this planner's earlier "
            "baseline); separate_async = disaggregated one-step-off async without GAP, TSP or TAG "
            "(veRL-Omni's separate_async, MM-GRPO). The best plan is "
            + ", ".join(
                f"{row['best_speedup']:.2f}x {name}"
                for name, row in report["baselines"].items()
                if row is not None
            )
        )
    lines += [
        f"searched {s['candidates']} placements: {s['rejected_by_memory']} do not fit in memory, "
        f"{s['simulated']} simulated ({s['seconds']:.1f} s); times from "
        + "; ".join(f"{d}: {src}" for d, src in cm["times"].items())
    ]
    if report["best_colocated"] is None:
        lines.append("no colocated placement fits in memory: speedups are n/a")
    if "cpu" in cm["times"] and not cm["times"]["cpu"].startswith("profile"):
        lines.append(
            "cpu devices without a profile: nominal times only; run `digenrl profile --device cpu` "
            "and pass --profile"
        )
    lines.append(
        "predictions of the cost model + simulator, not measurements (docs/scaling.md); they predict "
        "samples per second, not learning: reward per wall-second is benchmarks/learning.py's"
    )
    return lines


# ------------------------------------------------------------------------------ the config


def trainer_micro_batch(r) -> int | None:
    """The micro-batch the memory model chose for the plan's trainer devices (the smallest over them)."""
    return min(
        (s.micro_batch for p in r.plan.pools if r.plan.role(p) != "rollout" for s in [r.setups[p.name]]),
        default=None,
    )


def plan_config(cfg: RunConfig, r, cluster) -> RunConfig:
    """``cfg`` with the plan's cluster, placement and engine sections (and micro-batch, device)."""
    from digenrl.config.run import validate_config
    from digenrl.placement.plan import apply_plan

    plan = replace(r.plan, micro_batch=trainer_micro_batch(r))
    out = apply_plan(cfg, plan, "cpu" if cluster.is_cpu else "cuda")
    data = out.model_dump(mode="json")
    data["train"].update(trainer_memory_settings(r))
    data["sampling"]["cfg_batching"] = cfg_batching_setting(cfg, r)
    data["engine"]["rollout_batch"] = rollout_batch_setting(cfg, r)
    if not cluster.is_cpu:  # the run refuses a shard group wider than a node, as the search did
        data["cluster"]["gpus_per_node"] = cluster.gpus_per_node
    return validate_config(data)


def rollout_batch_setting(cfg: RunConfig, r):
    """``engine.rollout_batch`` as the cost model assumed it: the batch the rollout devices were sized
    and timed at (never the trainer's micro-batch), else the config's (``trainer``, or no rollout pool)."""
    pool = r.plan.rollout_pool
    batch = r.setups[pool.name].rollout_batch if pool is not None else None
    return batch or cfg.engine.rollout_batch


def cfg_batching_setting(cfg: RunConfig, r) -> str:
    """``sampling.cfg_batching`` as the plan assumes it: the mode every device was sized for, or
    ``auto`` where the rollout and trainer devices differ (auto resolves per role by the same model)."""
    from digenrl.adapters import adapter_class

    if adapter_class(cfg.model.adapter).guidance_passes(cfg.sampling.guidance) == 1:
        return cfg.sampling.cfg_batching  # one pass per step: nothing to batch
    modes = {s.cfg_batched for s in r.setups.values()}
    return "auto" if len(modes) > 1 else "batched" if modes == {True} else "sequential"


def trainer_memory_settings(r) -> dict:
    """The sharding and checkpointing the memory model chose for the plan's trainer devices, as the
    ``train`` keys the runtime reads (the largest FSDP degree / checkpointing on if any pool needs it)."""
    chosen = [r.setups[p.name] for p in r.plan.pools if r.plan.role(p) != "rollout"]
    shard = max((s.shard for s in chosen), default=1)
    ckpt = any(s.checkpointing for s in chosen)
    return {"fsdp": shard if shard > 1 else "off", "activation_checkpointing": "on" if ckpt else "off"}


def write_plan_config(cfg: RunConfig, r, cluster, path: Path, row: dict) -> tuple[Path, Path]:
    """The plan's config at ``path`` and, beside it (``<path stem>.layout.json``), the layout that
    config resolves to (`placement.resolve.resolve`): exactly what ``train -c path`` will run."""
    from digenrl.placement.resolve import resolve

    out = plan_config(cfg, r, cluster)
    layout = resolve(out)  # before anything is written: a plan the runtime refuses is never written
    path = Path(path)
    header = [
        f"# written by `digenrl plan` for cluster {cluster.name} ({cluster.describe()})",
        f"# plan: {row['plan']}",
        f"# predicted: {row['samples_per_s']:.4g} samples/s, {row['iteration_s']:.4g} s/iteration, bubble "
        f"{row['bubble_fraction']:.1%}, {_fmt_speedup(row['speedup_vs_colocated'])} the best colocated plan",
        "# (a model prediction: compare with the run's metrics.jsonl samples_per_s / bubble_fraction)",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header) + "\n" + out.dump_yaml())
    layout_path = path.with_suffix(".layout.json")
    layout_path.write_text(json.dumps(layout.to_dict(), indent=1) + "\n")
    return path, layout_path
