"""``digenrl plan --peers``: DigenRL's best plan beside each peer as it runs (digenrl.planner.peers)
and beside our engine's strong baselines, with the kernel efficiencies every number used."""

from __future__ import annotations

from rich.table import Table

KINDS = {
    "colocated": "our engine",
    "colocated_whole_groups": "our engine",
    "separate_async": "our engine",
}


def peers_report(result, cost, cluster, peer_runs: dict) -> dict:
    """The ``peers`` section of ``plan --json``: per peer its phases and throughput, and the best
    plan's speedup over it; the efficiencies used on each device type and where they come from."""
    from digenrl.planner.efficiency import device_efficiency
    from digenrl.planner.peers import SOURCES
    from digenrl.planner.uncertainty import ratio_ranges

    best = result.ranked[0]
    spans = ratio_ranges(result, cost, cluster) if not cluster.is_cpu else {}
    devices = sum(cluster.devices.values())
    rows = {}
    for name, run in peer_runs.items():
        rows[name] = {
            "where": run.where,
            "fits": run.fits,
            "why_not": run.why_not or None,
            "phases_s": run.phases,
            "iteration_s": run.iteration_s if run.fits else None,
            "samples_per_s": run.samples_per_s if run.fits else None,
            "samples_per_device_s": run.per_device_s if run.fits else None,
            "digenrl_speedup": best.samples_per_s / run.samples_per_s
            if run.fits and run.samples_per_s
            else None,
            # its min..max over the cost model's leave-one-out fits (planner/uncertainty.py)
            "digenrl_speedup_range": spans.get(name),
            "sources": [{"what": what, "repo": repo, "path": path} for what, repo, path in SOURCES[name]],
        }
    efficiency = {}
    for d in cluster.devices:
        e = device_efficiency(cost.params, d)
        efficiency[d] = {
            "sampling": e.rollout,
            "training": e.train,
            "half_tokens": [e.half_tokens_rollout, e.half_tokens_train],
            "source": e.source,
        }
    return {
        "digenrl": {
            "speedup_range_vs_fastest": spans.get("fastest"),
            "plan": best.plan.label(),
            "samples_per_s": best.samples_per_s,
            "samples_per_device_s": best.samples_per_s / devices,
        },
        "peers": rows,
        "efficiency": efficiency,
    }


def peers_table(report: dict) -> Table:
    """DigenRL, our engine's strong baselines and the peers as they run, one row each."""
    p = report["peers"]
    t = Table(title="DigenRL beside the peers as they run (and our engine in the peers' arrangements)")
    for col in ("system", "kind", "arrangement"):
        t.add_column(col, overflow="fold")
    for col in ("samples/s", "s/iter", "per GPU/s", "DigenRL vs it"):
        t.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    d = p["digenrl"]
    t.add_row(
        "DigenRL",
        "best plan",
        d["plan"],
        f"{d['samples_per_s']:.4g}",
        "",
        f"{d['samples_per_device_s']:.3g}",
        "1.00x",
    )
    t.add_section()
    for name, row in (report.get("baselines") or {}).items():
        if row is None:
            t.add_row(name, KINDS.get(name, ""), "no plan fits", "", "", "", "")
            continue
        devices = sum(x["count"] for x in row["pools"])
        t.add_row(
            name,
            KINDS.get(name, ""),
            row["plan"],
            f"{row['samples_per_s']:.4g}",
            f"{row['iteration_s']:.4g}",
            f"{row['samples_per_s'] / devices:.3g}",
            f"{row['best_speedup']:.2f}x",
        )
    t.add_section()
    for name, row in p["peers"].items():
        if not row["fits"]:
            t.add_row(name, "peer as it runs", f"{row['where']}: {row['why_not']}", "", "", "", "")
            continue
        t.add_row(
            name,
            "peer as it runs",
            row["where"],
            f"{row['samples_per_s']:.4g}",
            f"{row['iteration_s']:.4g}",
            f"{row['samples_per_device_s']:.3g}",
            f"{row['digenrl_speedup']:.2f}x" + _span(row.get("digenrl_speedup_range")),
        )
    return t


def _span(r) -> str:
    return f" ({r[0]:.2f}..{r[1]:.2f})" if r else ""


def peers_notes(report: dict) -> list[str]:
    p = report["peers"]
    eff = "; ".join(
        f"{d}: sampling {e['sampling']:.3f} / training {e['training']:.3f} ({e['source']})"
        for d, e in p["efficiency"].items()
    )
    phases = [
        f"{name} phases (s): " + ", ".join(f"{k} {v:.3g}" for k, v in row["phases_s"].items())
        for name, row in p["peers"].items()
        if row["fits"]
    ]
    return phases + [
        "peers as they run = each peer's published arrangement with its structural costs, cited from its "
        "code (docs/scaling.md, 'The peers as they run'); our engine = DigenRL's engine in that arrangement",
        f"every row uses the same kernel efficiencies -- {eff}",
        "DigenRL vs it (a..b): the ratio's range over the cost model's leave-one-out fits, each judged on "
        "the published rows it did not see (docs/scaling.md, 'Ratios out of sample')",
    ]
