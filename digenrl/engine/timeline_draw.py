"""``timeline.png``: a whole-run utilisation strip per worker and the last iterations as a Gantt
chart, one row per worker (a multi-device group as one row), units coloured by kind and version."""

from __future__ import annotations

from pathlib import Path

COLOURS = {
    "start": (125, 125, 145),
    "rollout": (66, 133, 244),
    "train": (244, 160, 0),
    "step": (219, 68, 55),
    "sync": (15, 157, 88),
    "reward": (171, 71, 188),
}
#: sub-unit kinds drawn as thin bars (they nest in, or sit beside, a unit)
MINOR_KINDS = ("sync", "reward")
LABEL_W, MARGIN, ROW_H, STRIP_H, AXIS_H, TITLE_H, LEGEND_H = 150, 20, 34, 14, 28, 18, 24


def colour(kind: str, version: int) -> tuple[int, int, int]:
    """The kind's colour, lightened on odd versions so that consecutive versions differ."""
    r, g, b = COLOURS.get(kind, (128, 128, 128))
    if version % 2:
        r, g, b = (c + (255 - c) // 2 for c in (r, g, b))
    return r, g, b


def draw_timeline(tl, path: Path, width: int = 1400, window: int = 3) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    groups = tl.groups()  # lead -> its devices: one row per scheduled worker
    rows = list(groups)
    labels = {
        w: f"{tl.workers[w]}/{w}" + (f" x{len(d)} dev" if len(d) > 1 else "") for w, d in groups.items()
    }
    n = max(1, len(rows))
    spans = tl.iteration_spans()
    end = max((e.end for e in tl.events), default=1.0) or 1.0
    first = min((e.start for e in tl.events), default=0.0)
    origin = min(0.0, first)  # the run's start (0) or its first event, whichever is earlier
    detail_from = origin  # the detail: the last `window` iterations (start-up is in the strip only)
    if spans:
        detail_from = spans[sorted(spans)[-min(window, len(spans))]][0]
    strip_h = TITLE_H + STRIP_H * n + AXIS_H
    detail_h = TITLE_H + ROW_H * n + AXIS_H
    img = Image.new("RGB", (width, strip_h + detail_h + LEGEND_H + 10), "white")
    draw = ImageDraw.Draw(img)
    plot_w = width - LABEL_W - MARGIN
    drawn: set[str] = set()

    # whole run: utilisation strip per worker
    draw.text(
        (5, 3),
        f"whole run: utilisation per worker ({len(spans)} iterations, {end - origin:.3g} s)",
        fill="black",
        font=font,
    )
    for i, w in enumerate(rows):
        y0 = TITLE_H + i * STRIP_H
        draw.text((5, y0), labels[w], fill="black", font=font)
        for x, rgb in enumerate(_strip(tl, groups[w], origin, end, plot_w, drawn)):
            if rgb is not None:
                draw.line([LABEL_W + x, y0, LABEL_W + x, y0 + STRIP_H - 3], fill=rgb)
        draw.rectangle([LABEL_W, y0, LABEL_W + plot_w, y0 + STRIP_H - 3], outline=(200, 200, 200))
    axis_y = TITLE_H + STRIP_H * n
    _axis(draw, font, origin, end, plot_w, axis_y)
    for k, (s, _) in _every(spans, 12):  # iteration boundaries, at most ~12 labelled
        x = LABEL_W + (s - origin) / (end - origin) * plot_w
        draw.line([x, TITLE_H, x, axis_y], fill=(120, 120, 120))
        draw.text((x + 2, axis_y + 16), f"it {k}", fill=(90, 90, 90), font=font)
    if detail_from > origin:  # the detail window, marked on the strip
        x = LABEL_W + (detail_from - origin) / (end - origin) * plot_w
        draw.rectangle([x, TITLE_H - 2, LABEL_W + plot_w, axis_y], outline="black")

    # the detail window
    top = strip_h + TITLE_H
    last = sorted(spans)[-min(window, len(spans))] if spans else 0
    title = (
        f"last {window} iterations ({last}-{max(spans)}) in detail"
        if len(spans) > window
        else "every iteration in detail"
    )
    draw.text((5, strip_h + 3), title, fill="black", font=font)
    x = lambda t: LABEL_W + (t - detail_from) / (end - detail_from) * plot_w  # noqa: E731
    for i, w in enumerate(rows):
        y0 = top + i * ROW_H
        draw.rectangle([LABEL_W, y0, LABEL_W + plot_w, y0 + ROW_H - 4], fill=(245, 245, 245))
        draw.text((5, y0 + 10), labels[w], fill="black", font=font)
    for e in sorted(tl.events, key=lambda e: e.kind in MINOR_KINDS):  # minor bars on top
        if e.end < detail_from:
            continue
        i = rows.index(tl.lead_of(e.worker))
        y0, y1 = top + i * ROW_H, top + i * ROW_H + ROW_H - 4
        if e.kind in MINOR_KINDS and e.pool != "service":  # a service row holds nothing to nest in
            y0 = y1 - (ROW_H - 4) // 3
        x0, x1 = x(max(e.start, detail_from)), max(x(e.end), x(max(e.start, detail_from)) + 1)
        draw.rectangle([x0, y0, x1, y1], fill=colour(e.kind, e.version), outline=(60, 60, 60))
        drawn.add(e.kind)
        label = f"v{e.version}"
        if e.kind not in (*MINOR_KINDS, "start") and x1 - x0 > 6 * len(label) + 4:
            draw.text((x0 + 3, y0 + 3), label, fill="black", font=font)
    axis_y = top + ROW_H * n
    _axis(draw, font, detail_from, end, plot_w, axis_y)

    lx, ly = LABEL_W, axis_y + AXIS_H
    for kind in [k for k in COLOURS if k in drawn]:
        draw.rectangle([lx, ly, lx + 14, ly + 12], fill=colour(kind, 0))
        draw.text((lx + 18, ly), kind, fill="black", font=font)
        lx += 90
    path = Path(path)
    img.save(path)
    return path


def _strip(tl, devices: list[str], start: float, end: float, bins: int, drawn: set[str]) -> list:
    """Per pixel column of [start, end]: the colour of what the worker on ``devices`` did in that
    slice (kinds mixed by their share of it, blended with white by the idle share), or None when idle."""
    share = [dict() for _ in range(bins)]
    dt = (end - start) / bins
    mine = [
        e for e in tl.events if e.worker in devices and (e.kind not in MINOR_KINDS or e.pool == "service")
    ]
    for e in mine:
        b0, b1 = int((e.start - start) / dt), min(bins - 1, int((e.end - start) / dt))
        for b in range(max(0, b0), b1 + 1):
            overlap = min(e.end, start + (b + 1) * dt) - max(e.start, start + b * dt)
            if overlap > 0:
                share[b][e.kind] = share[b].get(e.kind, 0.0) + overlap / dt
                drawn.add(e.kind)
    out = []
    for s in share:
        busy = min(1.0, sum(s.values()))
        if busy <= 0:
            out.append(None)
            continue
        total = sum(s.values())
        mixed = [sum(COLOURS[k][c] * v / total for k, v in s.items()) for c in range(3)]
        out.append(tuple(int(255 - busy * (255 - m)) for m in mixed))
    return out


def _axis(draw, font, start: float, end: float, plot_w: int, y: int) -> None:
    draw.line([LABEL_W, y, LABEL_W + plot_w, y], fill="black")
    for j in range(11):
        t = start + (end - start) * j / 10
        x = LABEL_W + plot_w * j / 10
        draw.line([x, y, x, y + 4], fill="black")
        draw.text((x - 10, y + 5), f"{t:.3g}s", fill="black", font=font)


def _every(spans: dict, at_most: int):
    """Iteration spans to mark: every one, or every k-th so that at most ``at_most`` are labelled."""
    keys = sorted(spans)
    step = max(1, -(-len(keys) // at_most))
    return [(k, spans[k]) for k in keys[::step]]
