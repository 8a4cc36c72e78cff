"""A least-squares fit of named positive parameters to published rows, judged by leave-one-out.

Each :class:`Row` predicts one published figure from the parameters; the fit minimises the squared
log errors (a bound row only when it is exceeded) by Nelder-Mead in log space within each
parameter's range. :func:`leave_one_out` refits without each group of rows (rows of one script leave
together) and predicts the group from that fit: the error a row would have had, had it not been seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

Theta = dict[str, float]


@dataclass(frozen=True)
class Param:
    name: str
    start: float
    lo: float
    hi: float
    what: str = ""


@dataclass(frozen=True)
class Row:
    name: str
    group: str  # rows of one group are left out together
    published: float
    predict: Callable[[Theta], float]
    kind: str = (
        "peer"  # "peer" (a published figure) | "own" (DigenRL's measurement) | "bound" (an upper bound)
    )
    source: str = ""

    def residual(self, theta: Theta) -> float:
        r = math.log(max(self.predict(theta), 1e-12) / self.published)
        return max(r, 0.0) if self.kind == "bound" else r


def loss(rows: list[Row], theta: Theta) -> float:
    return sum(r.residual(theta) ** 2 for r in rows)


def _theta(params: list[Param], x: list[float]) -> Theta:
    return {p.name: math.exp(min(max(v, math.log(p.lo)), math.log(p.hi))) for p, v in zip(params, x)}


def fit(params: list[Param], rows: list[Row], start: Theta | None = None, iters: int = 600) -> Theta:
    """The parameters minimising :func:`loss` over ``rows`` (Nelder-Mead on the logs, clipped to
    each parameter's range), started from ``start`` or each parameter's own start."""
    x0 = [math.log((start or {}).get(p.name, p.start)) for p in params]

    def f(x):
        return loss(rows, _theta(params, x))

    simplex = [x0] + [[v + (0.3 if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-10 and max(abs(a - b) for a, b in zip(simplex[0], simplex[-1])) < 1e-6:
            break
        centre = [sum(c) / (len(simplex) - 1) for c in zip(*simplex[:-1])]
        worst = simplex[-1]

        def towards(t):
            return [c + t * (w - c) for c, w in zip(centre, worst)]

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, x)] for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    best = min(range(len(simplex)), key=values.__getitem__)
    return _theta(params, simplex[best])


def leave_one_out(params: list[Param], rows: list[Row], full: Theta | None = None) -> dict[str, Theta]:
    """Per group, the fit of every other row (started from ``full``, the fit of all rows)."""
    full = full or fit(params, rows)
    groups = dict.fromkeys(r.group for r in rows)
    return {g: fit(params, [r for r in rows if r.group != g], start=full) for g in groups}


def errors(rows: list[Row], full: Theta, loo: dict[str, Theta]) -> list[dict]:
    """Per row: published, in-sample prediction and error, and the prediction and error of the fit that
    left its group out."""
    out = []
    for r in rows:
        got, held = r.predict(full), r.predict(loo[r.group])
        out.append(
            {
                "name": r.name,
                "group": r.group,
                "kind": r.kind,
                "source": r.source,
                "published": r.published,
                "predicted": got,
                "error": got / r.published - 1,
                "loo_predicted": held,
                "loo_error": held / r.published - 1,
            }
        )
    return out


def summary(table: list[dict], kind: str = "peer") -> dict:
    """Worst and median |error| in sample and out (leave-one-out) over the rows of ``kind``."""
    rows = [t for t in table if t["kind"] == kind]
    if not rows:
        return {"rows": 0}

    def median(v):
        v = sorted(v)
        return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2

    ins, outs = [abs(t["error"]) for t in rows], [abs(t["loo_error"]) for t in rows]
    return {
        "rows": len(rows),
        "worst_error": max(ins),
        "median_error": median(ins),
        "worst_loo_error": max(outs),
        "median_loo_error": median(outs),
    }
