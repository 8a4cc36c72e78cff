"""Fit the cost model's free parameters on every published row and DigenRL's own GPU rows at once, judge
each row by the fit that left it out, and say what DigenRL's best plan predicts beside the peers.

    python benchmarks/peer_calibration.py [--json F] [--quick] [--write-fits]

What is fitted, read off, predicted (docs/scaling.md, "Calibration on published numbers"):

- fitted, together: the matmul efficiencies (sampling, training), seconds per kernel of an eager
  transformer call (x the kernels counted on the real class: planner/op_counts.py), a rollout server's
  seconds per request, a single controller's seconds per worker, MM-GRPO's judge rate -- over the rows
  of :func:`digenrl.planner.published_fit.rows` (fewer parameters than rows);
- read off veRL-Omni's breakdown (inputs, not predictions): its judge's seconds per image and its push's
  fixed part;
- judged: every row by the fit of the others (rows of one script leave together), ``loo_error``;
- the ratio of DigenRL's best plan to each peer as it runs today on the calibration's 4xH800, under the
  fit of all rows and its range over the leave-one-out fits.

``--write-fits`` writes the fits to digenrl/planner/cost_fit.json (the planner's defaults and the
ranges of ``digenrl plan --peers``). Analytic: seconds for --quick, a minute for the leave-one-out fits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from digenrl.planner import published_fit, uncertainty
from digenrl.planner.published import CALIBRATION, NOT_CHECKED, VERL_OMNI_PHASES


def calibration_phases(full: dict) -> list[dict]:
    """veRL-Omni's published Qwen-Image LoRA step, phase by phase, under the fit of all rows."""
    got = published_fit.calibration_phases(full, 1, published_fit.push_latency_s(full))
    inputs = ("reward", "update_weights")
    return [
        {
            "name": k,
            "published_s": v,
            "predicted_s": got[k],
            "error": got[k] / v - 1,
            "kind": "input (read off the breakdown)" if k in inputs else "predicted",
        }
        for k, v in VERL_OMNI_PHASES.items()
    ] + [{"name": "dispatch", "published_s": None, "predicted_s": got.get("dispatch", 0.0), "kind": "fitted"}]


def report(quick: bool = False) -> dict:
    r = published_fit.report(loo_fits=not quick)
    full = r["fits"]["all"]
    r["calibration"] = {
        "name": CALIBRATION.name,
        "source": CALIBRATION.source,
        "phases": calibration_phases(full),
    }
    r["ratios"] = published_fit.ratios(r["fits"])
    r["not_checked"] = list(NOT_CHECKED)
    return r


def print_report(r: dict) -> None:
    print("one fit over every row (planner/published_fit.py):")
    for p in r["params"]:
        print(f"   {p['name']:<24}{p['value']:>12.4g}  {p['what']}")
    ro = r["read_off"]
    print(
        f"read off veRL-Omni's breakdown: judge {ro['judge_s_per_image']:.3f} s/image, push latency "
        f"{ro['push_latency_s']:.2f} s"
    )
    print(f"\n{r['calibration']['name']}, phase by phase:")
    for p in r["calibration"]["phases"]:
        pub = f"{p['published_s']:>10.1f}" if p["published_s"] else f"{'-':>10}"
        err = f"{p['error']:>+8.1%}" if "error" in p else f"{'':>8}"
        print(f"   {p['name']:<16}{pub}{p['predicted_s']:>10.1f}{err}  {p['kind']}")
    print(f"\n{'row':<74}{'published':>10}{'error':>8}{'LOO':>8}")
    for t in r["rows"]:
        print(
            f"{t['name'][:73]:<74}{t['published']:>10.3g}{t['error']:>+8.0%}{t['loo_error']:>+8.0%}"
            f"  {t['kind']}"
        )
        if "outside" in t:
            print(f"   outside: {t['outside']}")
    for kind in ("peers", "own"):
        s = r[kind]
        print(
            f"{kind}: {s['rows']} rows, |error| worst {s['worst_error']:.0%} median {s['median_error']:.0%}; "
            f"leave-one-out worst {s['worst_loo_error']:.0%} median {s['median_loo_error']:.0%}"
        )
    for peer, v in r["ratios"].items():
        print(
            f"   DigenRL vs {peer} (4xH800): {v['all']:.2f}x, over the leave-one-out fits "
            f"{v['min']:.2f}..{v['max']:.2f}x"
        )
    for line in r["not_checked"]:
        print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    ap.add_argument("--quick", action="store_true", help="the fit of all rows only (no leave-one-out fits)")
    ap.add_argument("--write-fits", action="store_true", help=f"write the fits to {uncertainty.FITS_FILE}")
    args = ap.parse_args(argv)
    r = report(args.quick)
    print_report(r)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=1, default=str))
    if args.write_fits:
        uncertainty.write_fits(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
