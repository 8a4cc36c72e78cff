"""Regenerate the tables and Gantt charts of docs/scaling.md (model predictions, not measurements).

python docs/scaling/generate.py              # search every model x cluster: predictions.json, Gantt charts
python docs/scaling/generate.py --models "HunyuanVideo (13B)" ...   # only these rows (merged into it)
python docs/scaling/generate.py --published  # only each peer's published setup (merged into it)
python docs/scaling/generate.py --peers      # only the peers as they run (analytic, seconds; merged into it)
python docs/scaling/generate.py --markdown   # the tables of docs/scaling.md from predictions.json

Two kinds of baseline: OUR engine in the peers' arrangements (search.baselines) and the peers as they
run (search.peers: veRL-Omni colocated / separate_async, DanceGRPO, flow_grpo, with their structural
costs); every number uses the kernel efficiencies of planner/gpus.py (fitted to veRL-Omni's published
step by benchmarks/peer_calibration.py, whose table --markdown also prints). The tables: scaling_tables.py.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from digenrl.config.run import load_config
from digenrl.errors import UserError
from digenrl.planner import peer_verl_omni as verl
from digenrl.planner import peers as peer_models
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import load_cluster
from digenrl.planner.published import CALIBRATION, OUT_OF_SAMPLE, VERL_OMNI_PHASES
from digenrl.planner.search import baselines, ladder, search
from digenrl.planner.search import peers as peer_runs
from digenrl.planner.uncertainty import ratio_ranges
from digenrl.planner.workload import Workload

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scaling_tables.py, beside this script
from scaling_tables import (  # noqa: E402
    BASELINE_NAMES,
    CLUSTERS,
    GANTT,
    MODELS,
    OUT,
    ROOT,
    SEARCHED_DEVICES,
    markdown,
)


def _summary(r) -> dict | None:
    """A plan's label, throughput and bubble (None: nothing of that kind fits)."""
    if r is None:
        return None
    return {
        "plan": r.plan.label(),
        "sps": r.samples_per_s,
        "bubble": r.bubble_fraction,
        "notes": sorted({n for s in r.setups.values() for n in s.notes()}),
    }


def _model_of(key: str) -> str:
    """The model label of a predictions.json key ('label | cluster' or 'workload | label')."""
    first, second = key.split(" | ")
    return second if first == "workload" else first


def _peer(run) -> dict:
    """A peer as it runs: where, throughput, phases (or why it cannot run)."""
    if not run.fits:
        return {"where": run.where, "why_not": run.why_not}
    return {
        "where": run.where,
        "sps": run.samples_per_s,
        "iteration_s": run.iteration_s,
        "phases": {k: round(v, 2) for k, v in run.phases.items()},
    }


def published_row(setup) -> dict:
    """DigenRL's best plan and the peer as it runs on a peer's published setup (the same efficiencies,
    the judge's seconds per image from the calibration where the peer scores with it)."""
    w, cluster = setup.workload(), setup.load_cluster()
    params = CostModel(w, cluster).params
    if setup.peer.startswith("verl_omni"):
        params.model_reward_s = VERL_OMNI_PHASES["reward"] / (CALIBRATION.workload().samples / 4)
    cost = CostModel(w, cluster, params=params)
    devices = sum(cluster.devices.values())
    best, why = None, f"not searched: {devices} GPUs (the search's seconds grow with the devices)"
    if devices <= SEARCHED_DEVICES:
        try:
            best, why = search(cost, cluster, top=1).ranked[0], None
        except UserError as err:  # no placement DigenRL's engine runs fits: say why
            best, why = None, str(err)
    run = (  # as the published figure ran
        peer_models.MODELS[setup.peer](cost, cluster, replace(verl.PUBLISHED, **setup.settings))
        if setup.peer.startswith("verl_omni")
        else peer_models.MODELS[setup.peer](cost, cluster)
    )
    return {
        "peers_today": {name: _peer(r) for name, r in peer_runs(cost, cluster).items()},
        "setup": setup.name,
        "cluster": setup.cluster,
        "peer": setup.peer,
        "peer_run": _peer(run),
        "published_step_s": setup.published_step_s,
        "digenrl": _summary(best),
        "digenrl_why_not": why,
        "baselines": {name: _summary(r) for name, r in baselines(cost, cluster).items()}
        if devices <= SEARCHED_DEVICES
        else {},
    }


def main(only: list[str] | None = None) -> int:
    """Search the models (``only``: these labels, the other rows of predictions.json kept)."""
    rows = {}
    path = OUT / "predictions.json"
    if only:
        unknown = set(only) - set(MODELS)
        if unknown:
            print(f"unknown model labels {sorted(unknown)} (known: {list(MODELS)})", file=sys.stderr)
            return 2
        kept = json.loads(path.read_text())  # rows of the other models, as they were
        rows = {
            tuple(k.split(" | ")): v
            for k, v in kept.items()
            if _model_of(k) in MODELS and _model_of(k) not in only
        }
    t0 = time.time()
    for label, cfg_file in MODELS.items():
        if only and label not in only:
            continue
        cfg = load_config(ROOT / "configs" / cfg_file)
        w = Workload.from_config(cfg)
        for cname in CLUSTERS:
            cluster = load_cluster(ROOT / "configs" / "clusters" / f"{cname}.yaml")
            cost = CostModel(w, cluster)
            res = search(cost, cluster, top=1)
            best, col = res.ranked[0], res.best_colocated
            steps = ladder(cost, cluster)
            peers = baselines(cost, cluster)
            rows[(label, cname)] = {
                "peers": {name: _peer(run) for name, run in peer_runs(cost, cluster).items()},
                # DigenRL vs each peer (and the fastest): min..max over the leave-one-out fits
                "peer_ranges": ratio_ranges(res, cost, cluster),
                # DigenRL = the planner's pick: the engine runs every plan it proposes, colocated ones too
                "digenrl": _summary(best),
                "disaggregated": _summary(steps[-1][1]),  # the best disaggregated plan with every knob
                "baselines": {name: _summary(peers[name]) for name in BASELINE_NAMES},
                "best": best.plan.label(),
                "best_sps": best.samples_per_s,
                "best_bubble": best.bubble_fraction,
                "best_notes": sorted({n for s in best.setups.values() for n in s.notes()}),
                "col": col.plan.label() if col else None,
                "col_sps": col.samples_per_s if col else None,
                "col_bubble": col.bubble_fraction if col else None,
                "ladder": {name: (r.samples_per_s if r else None) for name, r in steps},
                "ladder_bubble": {name: (r.bubble_fraction if r else None) for name, r in steps},
                "seconds": res.seconds,
            }
            if (label, cname) == GANTT:
                best.save(OUT / "gantt_best")
                if col:
                    col.save(OUT / "gantt_colocated")
            print(
                f"{label} on {cname}: {rows[(label, cname)]['best']} {best.samples_per_s:.3f} sps "
                f"({time.time() - t0:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
        rows[("workload", label)] = w.summary()
    path.write_text(json.dumps({f"{k[0]} | {k[1]}": v for k, v in rows.items()}, indent=1, default=str))
    published()
    print(json.dumps({"cost_params": asdict(CostModel(w, cluster).params)}, indent=1))
    return 0


def refresh_peers() -> int:
    """Only the peers as they run and the ratios' leave-one-out ranges, for every model x cluster, into
    predictions.json."""
    path = OUT / "predictions.json"
    rows = json.loads(path.read_text())
    for label, cfg_file in MODELS.items():
        w = Workload.from_config(load_config(ROOT / "configs" / cfg_file))
        for cname in CLUSTERS:
            cluster = load_cluster(ROOT / "configs" / "clusters" / f"{cname}.yaml")
            cost = CostModel(w, cluster)
            rows[f"{label} | {cname}"]["peers"] = {n: _peer(r) for n, r in peer_runs(cost, cluster).items()}
            res = search(cost, cluster, top=5)
            rows[f"{label} | {cname}"]["peer_ranges"] = ratio_ranges(res, cost, cluster)
    path.write_text(json.dumps(rows, indent=1, default=str))
    return 0


def published() -> int:
    """Each peer's published setup (DigenRL beside the peer as it runs), merged into predictions.json."""
    path = OUT / "predictions.json"
    rows = json.loads(path.read_text())
    t0 = time.time()
    for setup in (CALIBRATION, *OUT_OF_SAMPLE):
        rows[f"published | {setup.name}"] = published_row(setup)
        print(f"{setup.name}: done ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    path.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown())
        sys.exit(0)
    if sys.argv[1:] == ["--peers"]:
        sys.exit(refresh_peers())
    if sys.argv[1:] == ["--published"]:
        sys.exit(published())
    if sys.argv[1:2] == ["--models"]:
        sys.exit(main(sys.argv[2:]))
    sys.exit(main())
