"""The cost model's fits (every row, and each leave-one-out fit) and the range a ratio takes over them.

``cost_fit.json`` is written by ``benchmarks/peer_calibration.py --write-fits``: the parameters fitted
on every published row and DigenRL's GPU rows (the defaults of ``CostParams`` and ``gpus.py``), and the
fit that left out each group of rows. A "DigenRL vs peer" ratio is recomputed under each leave-one-out
fit: its min..max is what the fit's own uncertainty allows (docs/scaling.md, "Ratios out of sample").
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import KERNEL_EFFICIENCY
from digenrl.planner.search import peers, search

FITS_FILE = Path(__file__).with_name("cost_fit.json")


def write_fits(report: dict, path: Path = FITS_FILE) -> None:
    """The fits of a peer_calibration report (with its leave-one-out fits) as the shipped file."""
    fits = report["fits"]
    data = {
        "written_by": "python benchmarks/peer_calibration.py --write-fits",
        "rows": [{"name": t["name"], "group": t["group"], "kind": t["kind"]} for t in report["rows"]],
        "all": fits["all"],
        "leave_one_out": {g: t for g, t in fits.items() if g != "all"},
        "summary": {"peers": report["peers"], "own": report["own"]},
    }
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@lru_cache(maxsize=1)
def fits() -> dict:
    return json.loads(FITS_FILE.read_text())


def distinct_fits(tolerance: float = 0.005) -> list[dict]:
    """The leave-one-out fits, those within ``tolerance`` of one already kept (every parameter) dropped:
    leaving out a row the fit barely leans on moves nothing."""
    kept: list[dict] = []
    for theta in fits()["leave_one_out"].values():
        if not any(all(abs(theta[k] / o[k] - 1) <= tolerance for k in theta) for o in kept):
            kept.append(theta)
    return kept


def params_under(theta: dict, base):
    """``base`` (a CostParams) with a fit's values where ``base`` keeps the fitted defaults: the Hopper
    efficiency pair (unless configured or profiled), the kernel cost, a controller's per-worker cost."""
    p = replace(base, op_launch_s=theta["op_launch_s"], dispatch_s_per_worker=theta["dispatch_s_per_worker"])
    if base.mfu_rollout is None and base.mfu_train is None:
        pair = (theta["mfu_rollout"], theta["mfu_train"])
        p.device_mfu = {**(base.device_mfu or {}), **dict.fromkeys(KERNEL_EFFICIENCY, pair)}
    return p


def ratio_ranges(result, cost, cluster, top: int = 5) -> dict[str, tuple[float, float]]:
    """Per peer (and "fastest": the fastest peer of each fit), (min, max) of DigenRL's best plan over
    the peer as it runs, under every leave-one-out fit: the ``top`` plans of ``result`` re-ranked
    under each fit (a lower bound of that fit's own best plan, which a full search could only raise),
    the peers re-modelled under it."""
    plans = [r.plan for r in result.ranked[:top]]
    spans: dict[str, list[float]] = {}
    for theta in distinct_fits():
        c = CostModel(
            cost.workload, cluster, params_under(theta, cost.params), cost.colocation, cost.overheads
        )
        best = search(c, cluster, top=1, plans=plans).ranked[0].samples_per_s
        runs = {n: r.samples_per_s for n, r in peers(c, cluster).items() if r.fits and r.samples_per_s}
        for name, sps in runs.items():
            spans.setdefault(name, []).append(best / sps)
        if runs:  # "fastest": the fastest peer under this fit
            spans.setdefault("fastest", []).append(best / max(runs.values()))
    return {name: (min(v), max(v)) for name, v in spans.items()}
