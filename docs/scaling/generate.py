"""Regenerate the tables and Gantt charts of docs/scaling.md (model predictions, not measurements).

python docs/scaling/generate.py              # search every model x cluster: predictions.json, Gantt charts
python docs/scaling/generate.py --models "HunyuanVideo (13B)" ...   # only these rows (merged into it)
python docs/scaling/generate.py --markdown   # the tables of docs/scaling.md from predictions.json
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from digenrl.config import load_config
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import load_cluster
from digenrl.planner.search import baselines, ladder, search
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
                "digenrl": _summary(steps[-1][1]),  # the best disaggregated plan with every knob
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
    print(json.dumps({"cost_params": asdict(CostModel(w, cluster).p)}, indent=1))
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
    return a["sps"] / b["sps"] if a and b and b["sps"] else None


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
        "vs separate_async | planner's pick vs new colocated | paper |",
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
            pick = [
                r["best_sps"] / r["baselines"]["colocated"]["sps"] if r["baselines"]["colocated"] else None
                for r in rows
            ]
            lines.append(
                f"| {label} | {kind} ({', '.join(names)}) | {_span(list(map(_ratio, dg, old)))} | "
                f"{_span(list(map(_ratio, dg, new)))} | {_span(list(map(_ratio, dg, sep)))} | "
                f"{_span(pick)} | {PAPER_CLAIM} |"
            )
    return lines + [""]


def baseline_markdown(d: dict) -> list[str]:
    """Per model: DigenRL (the best disaggregated plan, every knob) against each peer arrangement."""
    lines = []
    for label in MODELS:
        lines += [
            f"### {label}",
            "",
            "| cluster | DigenRL (GAP+TSP+TAG+async) | old colocated (whole groups) | new colocated "
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


def markdown(path: Path = OUT / "predictions.json") -> str:
    """The tables of docs/scaling.md from predictions.json."""
    d = json.loads(path.read_text())
    lines = ["### Summary: DigenRL's predicted gain over each baseline", ""] + summary_markdown(d)
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
    if sys.argv[1:2] == ["--models"]:
        sys.exit(main(sys.argv[2:]))
    sys.exit(main())
