"""The tables of docs/scaling.md, made from docs/scaling/predictions.json (``generate.py --markdown``
prints them); the models, clusters and labels both files use."""

from __future__ import annotations

import json
from pathlib import Path

from digenrl.planner.search import PEERS

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
MODELS = {
    "FLUX.1-dev (12B)": "flux1_dev.yaml",
    "Wan2.1-T2V-14B 480p": "wan2.1_t2v_14b.yaml",
    "Wan2.1-T2V-14B 240p": "wan2.1_t2v_14b_240p.yaml",
    "HunyuanVideo (13B)": "hunyuan_video.yaml",
    "Qwen-Image (20B)": "qwen_image.yaml",
    "SD3.5-Medium (2.5B)": "sd3.5_medium.yaml",
    "Wan2.2-T2V-A14B 480p": "wan2.2_t2v_a14b.yaml",
}
CLUSTERS = ["16xH800", "8xH800_16xH20", "32xA100", "16xH100_16xL40S"]
GANTT = ("FLUX.1-dev (12B)", "8xH800_16xH20")
PAPER_CLAIM = "1.56-2.10x"  # the seed paper's end-to-end speedups over its baselines, on 16-32 GPU testbeds
BASELINE_NAMES = ("colocated_whole_groups", "colocated", "separate_async")
SEARCHED_DEVICES = 32  # published setups on more GPUs are not searched (64xH100: minutes per plan)


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
        + ". The same comparison from a config: `digenrl plan -c "
        "configs/recipes/verl_omni_qwen_image_ocr_lora.yaml --cluster configs/clusters/4xH800.yaml "
        "--peers` (the judge served on the 4 GPUs: `server: cluster`).",
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
    for g in r["out_of_sample_generation"]:  # a generation phase at several max_num_seqs
        lines += [
            "",
            f"Out of sample, a generation phase: {g['name']} ({g['source']}):",
            "",
            "| max_num_seqs | images per forward | published s | predicted s | error |",
            "|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {x['max_num_seqs']} | {x['images_per_forward']} | {x['published_s']:.1f} | "
            f"{x['predicted_s']:.1f} | {x['error']:+.0%} |"
            for x in g["rows"]
        ]
        lines += ["", g["caveat"] + "."]
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
