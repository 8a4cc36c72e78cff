"""Regenerate the tables and Gantt charts of docs/scaling.md (model predictions, not measurements).

python docs/scaling/generate.py              # search every model x cluster: predictions.json, Gantt charts
python docs/scaling/generate.py --models "HunyuanVideo (13B)" ...   # only these rows (merged into it)
python docs/scaling/generate.py --published  # only each peer's published setup (merged into it)
python docs/scaling/generate.py --peers      # only the peers as they run (analytic, seconds; merged into it)
python docs/scaling/generate.py --markdown   # the tables of docs/scaling.md from predictions.json

Two kinds of baseline: OUR engine in the peers' arrangements (search.baselines) and the peers as they
run (search.peers: veRL-Omni colocated / separate_async, DanceGRPO, flow_grpo, with their structural
costs); every number uses the kernel efficiencies of planner/gpus.py (fitted to veRL-Omni's published
step by benchmarks/peer_calibration.py, whose table --markdown also prints).
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
from digenrl.planner.search import PEERS, baselines, ladder, search
from digenrl.planner.search import peers as peer_runs
from digenrl.planner.workload import Workload

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
MODELS = {
    "FLUX.1-dev (12B)": "flux1_dev.yaml",
    "Wan2.1-T2V-14B 480p": "wan2.1_t2v_14b.yaml",
    "Wan2.1-T2V-14B 240p": "wan2.1_t2v_14b_240p.yaml",
    "HunyuanVideo (13B)": "hunyuan_video.yaml",
    "Qwen-Image (20B)": "qwen_image.yaml",
}
CLUSTERS = ["16xH800", "8xH800_16xH20", "32xA100", "16xH100_16xL40S"]
GANTT = ("FLUX.1-dev (12B)", "8xH800_16xH20")
PAPER_CLAIM = "1.56-2.10x"  # the seed paper's end-to-end speedups over its baselines, on 16-32 GPU testbeds
BASELINE_NAMES = ("colocated_whole_groups", "colocated", "separate_async")
SEARCHED_DEVICES = 32  # published setups on more GPUs are not searched (64xH100: minutes per plan)


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
    """Only the peers as they run (analytic, no search) for every model x cluster, into predictions.json."""
    path = OUT / "predictions.json"
    rows = json.loads(path.read_text())
    for label, cfg_file in MODELS.items():
        w = Workload.from_config(load_config(ROOT / "configs" / cfg_file))
        for cname in CLUSTERS:
            cluster = load_cluster(ROOT / "configs" / "clusters" / f"{cname}.yaml")
            cost = CostModel(w, cluster)
            rows[f"{label} | {cname}"]["peers"] = {n: _peer(r) for n, r in peer_runs(cost, cluster).items()}
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


def _gain(a: dict | None, b: dict | None) -> str:
    return f"{a['sps'] / b['sps']:.2f}x" if a and b and b["sps"] else "n/a"


def _cell(r: dict | None) -> str:
    if r is None:
        return "none fits"
    notes = f" [{', '.join(r['notes'])}]" if r["notes"] else ""
    return f"{r['plan']}{notes}: {r['sps']:.3g} ({r['bubble']:.0%} idle)"


MIXED = {"8xH800_16xH20", "16xH100_16xL40S"}


def _ratio(a: dict | None, b: dict | None) -> float | None:
    return a["sps"] / b["sps"] if a and b and b.get("sps") else None


def _span(xs: list[float | None]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    lo, hi = min(xs), max(xs)
    return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}x"


def summary_markdown(d: dict) -> list[str]:
    """Per model and kind of cluster: DigenRL's predicted gain over each baseline, beside the paper's
    claim."""
    lines = [
        "| model | clusters | DigenRL vs old colocated (whole groups) | vs new colocated (spread) | "
        "vs separate_async | best disaggregated (every knob) vs new colocated | paper |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label in MODELS:
        for kind, names in (
            ("homogeneous", [c for c in CLUSTERS if c not in MIXED]),
            ("mixed", [c for c in CLUSTERS if c in MIXED]),
        ):
            rows = [d[f"{label} | {c}"] for c in names]
            dg = [r["digenrl"] for r in rows]
            old, new, sep = ([r["baselines"][n] for r in rows] for n in BASELINE_NAMES)
            pick = [_ratio(r.get("disaggregated"), r["baselines"]["colocated"]) for r in rows]
            lines.append(
                f"| {label} | {kind} ({', '.join(names)}) | {_span(list(map(_ratio, dg, old)))} | "
                f"{_span(list(map(_ratio, dg, new)))} | {_span(list(map(_ratio, dg, sep)))} | "
                f"{_span(pick)} | {PAPER_CLAIM} |"
            )
    return lines + [""]


def baseline_markdown(d: dict) -> list[str]:
    """Per model: DigenRL (the planner's pick) against each of our engine's baseline arrangements."""
    lines = []
    for label in MODELS:
        lines += [
            f"### {label}",
            "",
            "| cluster | DigenRL (the planner's pick) | old colocated (whole groups) | new colocated "
            "(samples over every device) | separate_async | DigenRL vs old col. | vs new col. | "
            "vs separate_async | paper |",
            "|---|---|---|---|---|---:|---:|---:|---:|",
        ]
        for c in CLUSTERS:
            r = d[f"{label} | {c}"]
            dg, b = r["digenrl"], r["baselines"]
            old, new, sep = (b[n] for n in BASELINE_NAMES)
            lines.append(
                f"| {c} | {_cell(dg)} | {_cell(old)} | {_cell(new)} | {_cell(sep)} | {_gain(dg, old)} | "
                f"{_gain(dg, new)} | {_gain(dg, sep)} | {PAPER_CLAIM} |"
            )
        lines.append("")
    return lines


PEER_LABELS = {
    "verl_omni_colocated": "veRL-Omni colocated",
    "verl_omni_batched": "veRL-Omni batched + bypass",
    "verl_omni_async_reward": "veRL-Omni async reward",
    "verl_omni_separate_async": "veRL-Omni separate_async",
    "dancegrpo": "DanceGRPO",
    "flow_grpo": "flow_grpo",
}


def _peer_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "why_not" in r:
        return f"cannot run ({r['why_not']})"
    return f"{r['where']}: {r['sps']:.3g}"


def peers_markdown(d: dict) -> list[str]:
    """Per model and cluster: DigenRL beside our engine's baselines and each peer as it runs (samples/s)."""
    lines = []
    for label in MODELS:
        lines += [
            f"#### {label}",
            "",
            "| cluster | DigenRL | our engine colocated | our engine separate_async | "
            + " | ".join(PEER_LABELS[p] for p in PEERS)
            + " | DigenRL vs the fastest peer |",
            "|---|---|---|---|" + "---|" * len(PEERS) + "---:|",
        ]
        for c in CLUSTERS:
            r = d[f"{label} | {c}"]
            dg, b, pr = r["digenrl"], r["baselines"], r.get("peers", {})
            runs = [x for x in pr.values() if x and "sps" in x]
            fastest = max((x["sps"] for x in runs), default=None)
            gain = f"{dg['sps'] / fastest:.2f}x" if dg and fastest else "n/a"
            cells = [_cell(dg), _cell(b["colocated"]), _cell(b["separate_async"])]
            cells += [_peer_cell(pr.get(p)) for p in PEERS]
            lines.append(f"| {c} | " + " | ".join(cells) + f" | {gain} |")
        lines.append("")
    return lines


def peers_summary_markdown(d: dict) -> list[str]:
    """Per model and kind of cluster: DigenRL's predicted gain over each peer as it runs."""
    lines = [
        "| model | clusters | "
        + " | ".join(f"DigenRL vs {PEER_LABELS[p]}" for p in PEERS)
        + " | vs the fastest peer | vs our engine colocated |",
        "|---|---|" + "---:|" * (len(PEERS) + 2),
    ]
    for label in MODELS:
        for kind, names in (
            ("homogeneous", [c for c in CLUSTERS if c not in MIXED]),
            ("mixed", [c for c in CLUSTERS if c in MIXED]),
        ):
            rows = [d[f"{label} | {c}"] for c in names]
            cells = []
            for p in PEERS:
                cells.append(_span([_ratio(r["digenrl"], r["peers"].get(p)) for r in rows]))
            fastest = [
                max((x for x in r["peers"].values() if "sps" in x), key=lambda x: x["sps"], default=None)
                for r in rows
            ]
            cells.append(_span([_ratio(r["digenrl"], f) for r, f in zip(rows, fastest)]))
            cells.append(_span([_ratio(r["digenrl"], r["baselines"]["colocated"]) for r in rows]))
            lines.append(f"| {label} | {kind} ({', '.join(names)}) | " + " | ".join(cells) + " |")
    return lines + [""]


def published_markdown(d: dict) -> list[str]:
    """Each peer's published setup: the peer as it runs, DigenRL and our engine's baselines on it."""
    lines = [
        "| published setup | cluster | published s/step | peer as published: s/step, samples/s | "
        "fastest peer today: s/step, samples/s | DigenRL | our engine colocated | "
        "our engine separate_async | DigenRL vs the peer as published | DigenRL vs the fastest today |",
        "|---|---|---:|---|---|---|---|---|---:|---:|",
    ]
    for key, r in d.items():
        if not key.startswith("published | "):
            continue
        run, dg, b = r["peer_run"], r["digenrl"], r["baselines"]
        peer = f"{run['iteration_s']:.0f} s, {run['sps']:.3g}" if "sps" in run else run.get("why_not", "-")
        gain = f"{dg['sps'] / run['sps']:.2f}x" if dg and "sps" in run else "n/a"
        today = [(n, x) for n, x in r.get("peers_today", {}).items() if "sps" in x]
        name, top = max(today, key=lambda t: t[1]["sps"], default=(None, None))
        top_cell = (
            f"{PEER_LABELS[name]} ({top['where']}): {top['iteration_s']:.0f} s, {top['sps']:.3g}"
            if top
            else "-"
        )
        top_gain = f"{dg['sps'] / top['sps']:.2f}x" if dg and top else "n/a"
        if dg is None and (r.get("digenrl_why_not") or "").startswith("not searched"):
            dg_cell = r["digenrl_why_not"]
        elif dg is None and r.get("digenrl_why_not"):
            dg_cell = "no placement the engine runs fits (" + r["digenrl_why_not"].split(": ", 1)[-1] + ")"
        else:
            dg_cell = _cell(dg)
        lines.append(
            f"| {r['setup']} | {r['cluster']} | {r['published_step_s']:.0f} | {peer} | {top_cell} | "
            f"{dg_cell} | "
            f"{_cell(b.get('colocated')) if b else '-'} | {_cell(b.get('separate_async')) if b else '-'} | "
            f"{gain} | {top_gain} |"
        )
    return lines + [""]


def calibration_markdown() -> list[str]:
    """The calibration table (benchmarks/peer_calibration.py's report)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "peer_calibration", ROOT / "benchmarks" / "peer_calibration.py"
    )
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    r = cal.report()
    e, i, st = r["efficiency"], r["images_per_gpu_s"], r["step_s"]
    lines = [
        f"Fitted: sampling efficiency **{e['sampling']:.3f}** at large calls, half of it at "
        f"**{e['half_tokens']:.0f}** tokens per call (both through the two generation figures below), "
        f"training efficiency **{e['training']:.3f}** (half at 1024 tokens, an assumption). Read off the "
        f"breakdown: the judge's {r['inputs']['judge_s_per_image']:.3f} s per image, the push's fixed "
        f"{r['inputs']['push_latency_s']:.2f} s.",
        "",
        "Generation of the same Qwen-Image LoRA step, 32 x 16 at 512 px on 4xH800 "
        f"({e['generation_source']}):",
        "",
        "| max_num_seqs (requests = images per forward) | published s | fitted s | error |",
        "|---:|---:|---:|---:|",
    ]
    for g in r["generation"]:
        lines.append(
            f"| {g['max_num_seqs']} | {g['published_s']:.1f} | {g['predicted_s']:.1f} | {g['error']:+.1%} |"
        )
    lines += [
        "",
        "The published step (PR #52 and docs/algo/performance.md, serial: it predates request batching):",
        "",
        "| phase | published s | predicted s | error | kind |",
        "|---|---:|---:|---:|---|",
    ]
    for p in r["phases"]:
        lines.append(
            f"| {p['name']} | {p['published_s']:.1f} | {p['predicted_s']:.1f} | {p['error']:+.1%} | "
            f"{p['kind']} |"
        )
    lines += [
        f"| step | {st['published']:.0f} | {st['predicted']:.1f} | "
        f"{st['predicted'] / st['published'] - 1:+.1%} | "
        "sum of the phases (the published 420 s also holds ~11 s outside them) |",
        f"| images/GPU/s | {i['published']:.3f} | {i['predicted']:.3f} | {i['error']:+.1%} | predicted |",
        "",
        f"Worst predicted phase: {r['worst_predicted_phase_error']:.1%}. DigenRL's best plan on the same "
        f"4 H800s with the same pair and judge: {r['digenrl']['label']}, "
        f"{r['digenrl']['images_per_gpu_s']:.3f} images/GPU/s "
        f"({r['digenrl']['speedup_vs_verl_omni']:.2f}x veRL-Omni as published). The peers as they run "
        "today on the same GPUs: "
        + "; ".join(
            f"{PEER_LABELS[n]} ({p['where']}) {p['images_per_gpu_s']:.3f} images/GPU/s, "
            f"{p['iteration_s']:.0f} s/step (DigenRL "
            f"{r['digenrl']['images_per_gpu_s'] / p['images_per_gpu_s']:.2f}x)"
            for n, p in r["digenrl"]["peers_today"].items()
        )
        + ".",
        "",
        "Out of sample (the same pair, nothing refitted):",
        "",
        "| published figure | published s/step | predicted s/step | error | note |",
        "|---|---:|---:|---:|---|",
    ]
    for o in r["out_of_sample"]:
        note = o["caveat"]
        if "published_images_per_gpu_s" in o:
            note += (
                f"; images/GPU/s {o['published_images_per_gpu_s']:.3f} published, "
                f"{o['predicted_images_per_gpu_s']:.3f} predicted ({o['images_per_gpu_s_error']:+.0%})"
            )
        lines.append(
            f"| {o['name']} ({o['source']}) | {o['published_step_s']:.0f} | {o['predicted_step_s']:.0f} | "
            f"{o['step_error']:+.0%} | {note}; phases {o['phases']} |"
        )
    return lines + [""] + [f"- {x}" for x in r["not_checked"]] + [""]


def markdown(path: Path = OUT / "predictions.json") -> str:
    """The tables of docs/scaling.md from predictions.json."""
    d = json.loads(path.read_text())
    lines = ["### Calibration on published numbers", ""] + calibration_markdown()
    lines += ["### DigenRL on each peer's published setup", ""] + published_markdown(d)
    lines += ["### Summary: DigenRL's predicted gain over the peers as they run", ""]
    lines += peers_summary_markdown(d)
    lines += ["### DigenRL beside the peers as they run (samples/s)", ""] + peers_markdown(d)
    lines += ["### Summary: DigenRL's predicted gain over our engine's baselines", ""] + summary_markdown(d)
    lines += ["### Per model and cluster", ""] + [x.replace("### ", "#### ") for x in baseline_markdown(d)]
    lines += ["### The planner's pick and what each knob adds", ""]
    for label in MODELS:
        w = d[f"workload | {label}"]
        t = w["tokens"]
        lines += [
            f"#### {label}",
            "",
            f"{w['prompts']} prompts x {w['group_size']} samples per iteration, {w['steps']} steps, "
            f"{w['trained_steps']} trained steps per sample ({w['timestep_mode']}), {w['passes']} pass(es) "
            f"per step, KL {'on' if w['kl'] else 'off'}, LoRA {w['params']['lora'] / 1e6:.0f}M params; "
            f"{t['x']} image/video + {t['text']} text tokens, {w['forward_tflops_per_sample']:.1f} TFLOPs "
            "per sample per pass.",
            "",
            "| cluster | best plan | samples/s | bubble | best colocated | samples/s | bubble | speedup |",
            "|---|---|---:|---:|---|---:|---:|---:|",
        ]
        for c in CLUSTERS:
            r = d[f"{label} | {c}"]
            notes = f" [{', '.join(r['best_notes'])}]" if r["best_notes"] else ""
            col = r["col"] or "none fits"
            col_sps = f"{r['col_sps']:.3g}" if r["col_sps"] else "-"
            col_b = f"{r['col_bubble']:.0%}" if r["col_bubble"] is not None else "-"
            sp = f"{r['best_sps'] / r['col_sps']:.2f}x" if r["col_sps"] else "n/a"
            lines.append(
                f"| {c} | {r['best']}{notes} | {r['best_sps']:.3g} | {r['best_bubble']:.0%} | {col} | "
                f"{col_sps} | {col_b} | {sp} |"
            )
        lines += [
            "",
            "What each knob adds (best disaggregated plan with the knobs up to that column; samples/s):",
            "",
            "| cluster | sync | +GAP | +TSP | +TAG | +async (= DigenRL) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for c in CLUSTERS:
            lad = d[f"{label} | {c}"]["ladder"]
            lines.append(
                f"| {c} | "
                + " | ".join(
                    f"{lad[k]:.3g}" if lad[k] else "-" for k in ("sync", "+GAP", "+TSP", "+TAG", "+async")
                )
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


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
