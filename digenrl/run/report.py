"""``digenrl report RUN``: one HTML page of a run that opens offline -- the reward curves per component
and the diagnosis metrics (inline SVG drawn here from ``metrics.jsonl``), the sample grids over the
iterations and the evaluations, the engine's timeline (PNGs embedded as data URIs), the diagnosis line
of a flat run (:mod:`digenrl.run.diagnose`). No script, no network: a file to mail or archive.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from digenrl.config.run import load_config
from digenrl.errors import UserError
from digenrl.run.diagnose import diagnosis
from digenrl.run.rundir import read_metrics

#: the curves drawn, one chart each: (title, metric keys; ``reward/*`` expands to every component)
CHARTS = [
    ("reward (mean over the iteration's samples) and each component", ["reward_mean", "reward/*"]),
    ("why the reward may not move: zero-variance groups, spread in a group",
     ["groups_zero_std", "reward_std_in_group"]),
    ("the update: clip fraction and KL", ["clip_frac", "kl"]),
    ("speed: samples per second", ["samples_per_s"]),
]  # fmt: skip
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
W, H, PAD, LEGEND = 470, 220, 44, 160  # the plot, then the legend to its right


def _data_uri(path: Path) -> str:
    kind = {"png": "image/png", "gif": "image/gif", "jpg": "image/jpeg"}.get(path.suffix[1:], "image/png")
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode()}"


def _series(rows: list[dict], keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    names = []
    for key in keys:
        if key.endswith("/*"):
            names += sorted({k for r in rows for k in r if k.startswith(key[:-1])})
        else:
            names.append(key)
    out = {}
    for name in names:
        pts = [
            (r["iteration"], float(r[name]))
            for r in rows
            if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])
        ]
        if pts:
            out[name] = pts
    return out


def svg_chart(title: str, series: dict[str, list[tuple[int, float]]]) -> str:
    """A line chart of ``series`` (name -> (iteration, value) points) as inline SVG, axes labelled."""
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def px(x, y):
        return PAD + (x - x0) / (x1 - x0) * (W - 2 * PAD), H - PAD + (y - y0) / (y1 - y0) * (2 * PAD - H)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W + LEGEND}" height="{H}" role="img">',
        f'<rect width="{W + LEGEND}" height="{H}" fill="white"/>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#888"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#888"/>',
        f'<text x="{PAD}" y="{H - PAD + 16}" font-size="11">{x0}</text>',
        f'<text x="{W - PAD}" y="{H - PAD + 16}" font-size="11" text-anchor="end">{x1} (iteration)</text>',
        f'<text x="{PAD - 4}" y="{H - PAD}" font-size="11" text-anchor="end">{y0:.3g}</text>',
        f'<text x="{PAD - 4}" y="{PAD + 4}" font-size="11" text-anchor="end">{y1:.3g}</text>',
    ]
    for i, (name, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        xy = [px(x, y) for x, y in pts]
        coords = " ".join(f"{a:.1f},{b:.1f}" for a, b in xy)
        if len(xy) <= 60:  # few points (a short run): each one marked, a single one visible at all
            parts += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{colour}"/>' for a, b in xy]
        parts.append(
            f'<polyline data-series="{html.escape(name)}" fill="none" stroke="{colour}" stroke-width="1.5" '
            f'points="{coords}"/>'
        )
        parts.append(
            f'<text x="{W - PAD + 12}" y="{PAD + 14 * i}" font-size="11" fill="{colour}">'
            f"{html.escape(name)}</text>"
        )
    parts.append("</svg>")
    return f"<figure><h3>{html.escape(title)}</h3>\n" + "\n".join(parts) + "</figure>"


def _images(title: str, paths: list[Path]) -> str:
    if not paths:
        return ""
    figs = "\n".join(
        f'<figure><img src="{_data_uri(p)}" alt="{html.escape(p.stem)}"><figcaption>'
        f"{html.escape(p.parent.name + '/' + p.name if p.parent.name != 'samples' else p.stem)}"
        "</figcaption></figure>"
        for p in paths
    )
    return f"<h2>{html.escape(title)}</h2>\n<div class=grid>{figs}</div>"


def build_report(run: Path) -> str:
    """The page's HTML for run directory ``run``; a UserError when it holds no run."""
    run = Path(run)
    if not (run / "metrics.jsonl").is_file():
        raise UserError(f"RUN: {run} holds no metrics.jsonl (not a run directory, or one not yet started)")
    rows = read_metrics(run)
    cfg = load_config(run / "config.yaml") if (run / "config.yaml").is_file() else None
    head = f"{run.name}: {len(rows)} iterations"
    if cfg is not None:
        head += f", {cfg.model.adapter}, {cfg.algorithm.name}, placement {cfg.placement.mode}"
    body = [f"<h1>{html.escape(head)}</h1>"]
    if rows:
        k = max(1, len(rows) // 3)
        first = sum(r["reward_mean"] for r in rows[:k]) / k
        last = sum(r["reward_mean"] for r in rows[-k:]) / k
        gain = f"reward (mean of first third -> last third): {first:.4f} -> {last:.4f} ({last - first:+.4f})"
        body.append(f"<p>{html.escape(gain)}</p>")
        why = diagnosis(rows, *((cfg.algorithm.clip_range, cfg.algorithm.kl_beta) if cfg else ()))
        if why:
            body.append(f"<p class=why>{html.escape(why)}</p>")
        charts = [svg_chart(title, series) for title, keys in CHARTS if (series := _series(rows, keys))]
        body.append("<h2>curves</h2>\n<div class=grid>" + "\n".join(charts) + "</div>")
    samples = sorted((run / "samples").glob("iter-*.*")) if (run / "samples").is_dir() else []
    body.append(
        _images("samples over the iterations (one per prompt group, captioned with its reward)", samples)
    )
    evals = sorted(p for p in (run / "eval").glob("*/*") if p.name in ("eval.png", "eval.gif", "compare.png"))
    body.append(_images("evaluations (ODE, fixed seeds)", evals))
    if (run / "timeline.png").is_file():
        timeline = _images("timeline (one row per worker; units by kind and version)", [run / "timeline.png"])
        body.append(timeline.replace("<img ", "<img class=wide ", 1))
    style = (
        "body{font-family:sans-serif;max-width:1400px;margin:1em auto;padding:0 1em}"
        ".grid{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0}img{max-width:680px;image-rendering:pixelated}"
        "figcaption{font-size:12px;color:#555}.why{background:#fff3cd;padding:6px}img.wide{max-width:100%}"
        "h3{font-size:14px;margin:4px 0}"
    )
    return (
        f"<!doctype html>\n<html><head><meta charset=utf-8><title>{html.escape(run.name)}</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(b for b in body if b) + "\n</body></html>\n"
    )


def write_report(run: Path, out: Path | None = None) -> Path:
    """Write the page (default ``RUN/report.html``), atomically; returns its path."""
    out = Path(out) if out is not None else Path(run) / "report.html"
    text = build_report(run)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return out
