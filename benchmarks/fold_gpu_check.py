"""Fold the GPU check's measurements into the planner's defaults: what each measured number replaces.

    python benchmarks/fold_gpu_check.py OUT [--json F]

OUT is the directory ``benchmarks/gpu_smoke.sh`` wrote (``dedicated.json``; ``realwidth.json`` when
it is there). For every planner default the check measures, prints where it lives, its value now and
the measured one:

- sampling: the kernel-efficiency curve ``mfu(n) = peak n / (n + half)`` (digenrl/planner/efficiency.py)
  fitted to ``rollout_batch_curve`` (MFU at batch 1, 2, 4, 8) -> the sampling peak of
  ``gpus.KERNEL_EFFICIENCY[<gpu>]`` and ``CostParams.mfu_half_tokens_rollout``;
- training: the peak the real-width train step's MFU implies at its token count, at the default half
  (realwidth.json ``train_ac_off``: one batch, so no half of its own) -> the training peak;
- a model reward: PickScore's (ViT-H/14) seconds per image at the largest call measured ->
  ``CostParams.model_reward_s``, its parameters -> ``CostParams.model_reward_params``, the share of
  its time hidden while the next unit samples on the same device -> ``CostParams.model_reward_overlap``;
- compiled sampling: the speed-up of ``engine.compile_rollout: on`` (the planner models eager sampling:
  no default to replace yet; reported).

Nothing is edited: the defaults are constants with their source in a comment, changed by hand (with
the GPU, the date and the commit the check ran on). A CPU dry run (``DEVICE=cpu``, tiny models) is
reported as not applicable (``applies: false``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from digenrl.planner.constants import MFU_CAP  # noqa: E402
from digenrl.planner.efficiency import DEFAULT_HALF_TOKENS, fit_curve, tokens_factor  # noqa: E402
from digenrl.planner.gpus import GENERIC_EFFICIENCY, KERNEL_EFFICIENCY  # noqa: E402
from digenrl.planner.params import CostParams  # noqa: E402


def sampling_curve(ded: dict) -> tuple[float, float] | None:
    """(peak, half) through the measured MFU points, None without MFUs (CPU)."""
    points = {
        row["tokens_per_call"]: row["mfu"]
        for row in (ded.get("rollout_batch_curve") or {}).values()
        if row.get("mfu")
    }
    return fit_curve(points, MFU_CAP) if points else None


def training_peak(rw: dict | None, half: float) -> float | None:
    """The peak a train step's MFU implies at its token count (tokens x batch), at ``half``."""
    row = (rw or {}).get("train_ac_off") or {}
    mfu = row.get("mfu")
    if not isinstance(mfu, (int, float)) or mfu != mfu or mfu <= 0:
        return None
    tokens = rw["rollout"]["tokens"] * rw["rollout"]["batch"]
    return min(MFU_CAP, mfu / tokens_factor(tokens, half))


def reward_row(ded: dict, which: str = "pickscore") -> dict | None:
    rows = [r for r in ded.get("reward") or [] if r["reward"] == which]
    return max(rows, key=lambda r: r["images"]) if rows else None


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def call_costs(calls: dict) -> dict:
    """calls.json (benchmarks/gpu_calls.py) folded per family, kind and mode: seconds vs batch fitted by
    least squares (intercept: fixed seconds per call, slope: seconds per sample) at each depth run.
    With a half-depth fit beside the full one, the difference splits each into per block and the rest
    (embeddings, head); with one depth, all of it counts per block. ``published_*``: the rest + the
    published model's blocks x per block."""
    fits: dict[tuple, dict] = {}
    series: dict[tuple, list] = {}
    for r in calls.get("rows") or []:
        series.setdefault((r["family"], r["kind"], r["mode"], r["blocks_run"]), []).append(r)
    for (family, kind, mode, blocks), got in series.items():
        xs, ys = [r["batch"] for r in got], [r["median_s"] for r in got]
        if len(set(xs)) >= 2:  # one batch: no slope
            a, b = fit_line(xs, ys)
            resid = max(abs(a + b * x - y) / y for x, y in zip(xs, ys))
            fits.setdefault((family, kind, mode), {})[blocks] = (a, b, resid, xs, got[0])
    models = calls.get("models") or {}
    rows = []
    for (family, kind, mode), by in fits.items():
        n, half = max(by), (min(by) if len(by) > 1 else None)
        fixed, slope, resid, xs, first = by[n]
        if half is None:
            per_block, rest = (fixed / n, slope / n), (None, None)
        else:
            per_block = ((fixed - by[half][0]) / (n - half), (slope - by[half][1]) / (n - half))
            rest = (fixed - n * per_block[0], slope - n * per_block[1])
        published = first["published_blocks"]
        full, halved = models.get(family) or {}, models.get(f"{family}/half") or {}
        kernels = (full.get("kernels_per_forward") or {}).get(mode) if kind == "forward" else None
        kernels_half = (halved.get("kernels_per_forward") or {}).get(mode) if kind == "forward" else None
        ops, ops_half = full.get("aten_ops_per_forward"), halved.get("aten_ops_per_forward")
        rows.append(
            {
                "family": family,
                "kind": kind,
                "mode": mode,
                "batches": xs,
                "blocks_run": n,
                "blocks_run_half": half,
                "published_blocks": published,
                "hidden": first["hidden"],
                "tokens": first["tokens"],
                "fixed_s": fixed,
                "per_sample_s": slope,
                "fixed_s_per_block": per_block[0],
                "per_sample_s_per_block": per_block[1],
                "fixed_s_outside_blocks": rest[0],
                "per_sample_s_outside_blocks": rest[1],
                "published_fixed_s": (rest[0] or 0.0) + published * per_block[0],
                "published_per_sample_s": (rest[1] or 0.0) + published * per_block[1],
                "max_rel_residual": max(f[2] for f in by.values()),
                "kernels_per_forward": kernels,
                "kernels_per_block": _per_block(kernels, kernels_half, n, half),
                "aten_ops_per_block": _per_block(ops, ops_half, n, half) if kind == "forward" else None,
                "fixed_s_per_kernel": fixed / kernels if kernels else None,
            }
        )
    ray = calls.get("ray_call") or {}
    return {
        "device": calls.get("device"),
        "gpu": calls.get("gpu"),
        "applies": bool(calls.get("gpu")) and not calls.get("tiny"),
        "ray_call_s": ray.get("median_s"),
        "rows": rows,
        "skipped": calls.get("skipped") or [],
        "errors": calls.get("errors") or {},
    }


def _per_block(full, half, n: int, n_half: int | None) -> float | None:
    """A count's share per block from the full and half depth (None without both)."""
    return None if full is None or half is None or n_half is None else (full - half) / (n - n_half)


def fold(out: Path) -> dict:
    ded_file, calls_file = out / "dedicated.json", out / "calls.json"
    if not ded_file.is_file() and not calls_file.is_file():
        print(f"fold_gpu_check: {out} holds neither dedicated.json nor calls.json", file=sys.stderr)
        raise SystemExit(2)
    ded = json.loads(ded_file.read_text()) if ded_file.is_file() else {}
    rw_file = out / "realwidth.json"
    rw = json.loads(rw_file.read_text()) if rw_file.is_file() else None
    gpu = ded.get("gpu")
    now = KERNEL_EFFICIENCY.get(gpu, GENERIC_EFFICIENCY)
    table = f"digenrl/planner/gpus.py KERNEL_EFFICIENCY[{gpu!r}]" if gpu else "(no GPU type: a dry run)"
    defaults = CostParams()
    rows = []

    def row(name, where, current, measured, note=""):
        rows.append({"name": name, "where": where, "now": current, "measured": measured, "note": note})

    curve = sampling_curve(ded)
    row("sampling peak efficiency", f"{table}[0]", now[0], curve and curve[0], "fit to MFU at batch 1-8")
    row(
        "sampling half tokens",
        "digenrl/planner/params.py CostParams.mfu_half_tokens_rollout",
        defaults.mfu_half_tokens_rollout,
        curve and curve[1],
    )
    # the efficiency curve of a profile (the analytic model's default has none: it prices kernels apart)
    half = defaults.mfu_half_tokens_train or DEFAULT_HALF_TOKENS
    row("training peak efficiency", f"{table}[1]", now[1], training_peak(rw, half), f"at half {half:.0f}")
    pick = reward_row(ded)
    row(
        "model reward s per image",
        "digenrl/planner/params.py CostParams.model_reward_s",
        defaults.model_reward_s,
        pick and pick["s_per_image"],
        pick and f"{pick['backbone']} {pick['dtype']}, {pick['images']} images per call",
    )
    row(
        "model reward parameters",
        "digenrl/planner/params.py CostParams.model_reward_params",
        defaults.model_reward_params,
        pick and pick["params"],
    )
    lap = ded.get("reward_overlap") or {}
    row(
        "model reward overlap",
        "digenrl/planner/params.py CostParams.model_reward_overlap",
        defaults.model_reward_overlap,
        lap.get("hidden_share"),
        lap and f"{lap['reward']} ({lap['images']} images) beside sampling at batch {lap['sample_batch']}",
    )
    comp = ded.get("compile") or {}
    row(
        "compiled sampling speed-up",
        "none yet (the planner models eager sampling)",
        1.0,
        comp.get("speedup"),
        comp and f"mode {comp['mode']}, backend {comp['backend']}, batch {comp['batch']}",
    )
    return {
        "device": ded.get("device"),
        "gpu": gpu,
        "applies": bool(gpu) and not ded.get("tiny"),
        "errors": ded.get("errors") or {},
        "defaults": rows,
        "call_costs": call_costs(json.loads(calls_file.read_text())) if calls_file.is_file() else None,
    }


def print_call_costs(costs: dict) -> None:
    ray = costs["ray_call_s"]
    dry = "" if costs["applies"] else "  (a CPU / tiny dry run)"
    print(
        f"call costs on {costs['device']}: Ray actor round trip {'-' if ray is None else f'{ray:.3g} s'}{dry}"
    )
    for r in costs["rows"]:
        ms = {k: (r[k] or 0.0) * 1e3 for k in r if k.endswith("_s") or "_s_" in k}
        rest = "" if r["blocks_run_half"] is None else f" {ms['fixed_s_outside_blocks']:+.3g} ms"
        print(
            f"  {r['family']:<5} {r['kind']:<10} {r['mode']:<8} fixed {ms['fixed_s_per_block']:.3g} ms per"
            f" block{rest} (x {r['published_blocks']}: {ms['published_fixed_s']:.3g} ms), per sample"
            f" {ms['published_per_sample_s']:.3g} ms; worst residual {r['max_rel_residual']:.0%}"
        )
    for s in costs["skipped"]:
        print(f"  skipped: {s}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the directory benchmarks/gpu_smoke.sh wrote")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = fold(args.out)
    verdict = "" if res["applies"] else "  (a CPU / tiny dry run: not planner defaults)"
    if res["device"] is not None:  # dedicated.json was there
        print(f"measured on {res['device']}{verdict}")
    for r in res["defaults"] if res["device"] is not None else []:
        got = "-" if r["measured"] is None else f"{r['measured']:.4g}"
        print(f"  {r['name']:<28} now {r['now']:<10.4g} measured {got:<10} {r['where']}  {r['note'] or ''}")
    for name, err in res["errors"].items():
        print(f"  section {name} failed: {err}")
    if res["call_costs"]:
        print_call_costs(res["call_costs"])
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
