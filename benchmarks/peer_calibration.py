"""Fit ONE pair of kernel efficiencies (sampling, training) to veRL-Omni's published step, check it out of
sample, and say what DigenRL's best plan predicts on the same GPUs with the same pair.

    python benchmarks/peer_calibration.py [--json F]

What is fitted, what is read off, what is predicted (docs/scaling.md, "Calibration on published numbers"):

- fitted: the sampling efficiency (to the generation phase) and the training efficiency (to
  update_actor + old_log_prob, least squares in log error): the pair every baseline and DigenRL use,
  and the default of H100 / H800 / H200 in digenrl/planner/gpus.py;
- read off the breakdown (inputs, not predictions): the reward judge's seconds per image (the reward
  phase / the images per GPU: a Qwen3-VL-8B served by vLLM that DigenRL does not model) and the fixed
  part of the weight push (update_weights - the modelled host/device moves);
- predicted: each phase, the step, images/GPU/s; and out of sample, the published figures of
  :data:`~digenrl.planner.published.OUT_OF_SAMPLE` (their error is printed, whatever it is).

Runs in seconds on a CPU (the analytic cost model only; nothing is measured here).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from digenrl.planner import peers as peer_models
from digenrl.planner.costmodel import CostModel
from digenrl.planner.params import CostParams
from digenrl.planner.published import (
    CALIBRATION,
    NOT_CHECKED,
    OUT_OF_SAMPLE,
    PREDICTED_PHASES,
    VERL_OMNI_PHASES,
    PublishedSetup,
)
from digenrl.planner.search import search

#: the tolerances the fit must meet (tests/test_peer_calibration.py asserts them)
WORST_PHASE_TOLERANCE = 0.20
IMAGES_PER_GPU_TOLERANCE = 0.10


def _params(rollout: float, train: float, judge_s: float | None) -> CostParams:
    p = CostParams(mfu_rollout=rollout, mfu_train=train, mfu_source="fitted to veRL-Omni's published step")
    if judge_s is not None:
        p.model_reward_s = judge_s
    return p


def _settings(setup: PublishedSetup, push_latency_s: float) -> peer_models.VerlOmniSettings:
    return replace(peer_models.VERL_OMNI, push_latency_s=push_latency_s, **setup.settings)


def phases(rollout: float, train: float, judge_s: float, push_latency_s: float) -> dict[str, float]:
    """veRL-Omni's step on the calibration setup, phase by phase, with these numbers."""
    w, cluster = CALIBRATION.workload(), CALIBRATION.load_cluster()
    cost = CostModel(w, cluster, params=_params(rollout, train, judge_s))
    device, n = next(iter(cluster.devices.items()))
    return peer_models.verl_omni_phases(cost, device, n, _settings(CALIBRATION, push_latency_s))


def golden(f, lo: float, hi: float, iters: int = 80) -> float:
    """The minimum of a unimodal ``f`` on [lo, hi] (golden-section search)."""
    r = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - r * (b - a), a + r * (b - a)
    for _ in range(iters):
        if f(c) < f(d):
            b, d = d, c
            c = b - r * (b - a)
        else:
            a, c = c, d
            d = a + r * (b - a)
    return (a + b) / 2


def fit() -> dict:
    """The pair, the judge's seconds per image and the push latency, fitted to the breakdown."""
    n = next(iter(CALIBRATION.load_cluster().devices.values()))
    judge_s = VERL_OMNI_PHASES["reward"] / (CALIBRATION.workload().samples / n)

    def err(name: str, got: float) -> float:
        return math.log(got / VERL_OMNI_PHASES[name]) ** 2

    rollout = golden(lambda r: err("generation", phases(r, 0.3, judge_s, 0.0)["generation"]), 0.02, 0.9)
    train = golden(
        lambda t: sum(
            err(k, v) for k, v in phases(rollout, t, judge_s, 0.0).items() if k in PREDICTED_PHASES[1:]
        ),
        0.02,
        0.9,
    )
    moves = phases(rollout, train, judge_s, 0.0)["update_weights"]
    return {
        "rollout": rollout,
        "train": train,
        "judge_s_per_image": judge_s,
        "push_latency_s": VERL_OMNI_PHASES["update_weights"] - moves,
    }


def predict(setup: PublishedSetup, f: dict) -> dict:
    """The peer's predicted step on a published setup with the fitted numbers, against what was published."""
    w, cluster = setup.workload(), setup.load_cluster()
    judge = f["judge_s_per_image"] if setup.peer.startswith("verl_omni") else None
    cost = CostModel(w, cluster, params=_params(f["rollout"], f["train"], judge))
    model = peer_models.MODELS[setup.peer]
    run = (
        model(cost, cluster, _settings(setup, f["push_latency_s"]))
        if setup.peer.startswith("verl")
        else model(cost, cluster)
    )
    out = {
        "name": setup.name,
        "peer": setup.peer,
        "source": setup.source,
        "published_step_s": setup.published_step_s,
        "predicted_step_s": run.iteration_s,
        "step_error": run.iteration_s / setup.published_step_s - 1,
        "phases": {k: round(v, 2) for k, v in run.phases.items()},
        "caveat": setup.caveat,
    }
    if setup.published_images_per_gpu_s:
        out["published_images_per_gpu_s"] = setup.published_images_per_gpu_s
        out["predicted_images_per_gpu_s"] = run.per_device_s
        out["images_per_gpu_s_error"] = run.per_device_s / setup.published_images_per_gpu_s - 1
    return out


def digenrl_best(f: dict) -> dict:
    """DigenRL's best plan on the calibration's GPUs, same pair, same judge (on the rollout devices)."""
    w, cluster = CALIBRATION.workload(), CALIBRATION.load_cluster()
    cost = CostModel(w, cluster, params=_params(f["rollout"], f["train"], f["judge_s_per_image"]))
    res = search(cost, cluster, top=1)
    best = res.ranked[0]
    n = sum(cluster.devices.values())
    return {
        "label": best.plan.label(),
        "images_per_gpu_s": best.samples_per_s / n,
        "iteration_s": best.iteration_s,
        "note": "DigenRL's engine as built: rollout-only workers sample at engine.rollout_batch (auto: the "
        "largest batch the memory model fits; TAG / colocated workers in the trainer's micro-batch), "
        "the judge on the rollout devices at the same seconds per image",
    }


def report() -> dict:
    f = fit()
    cal = phases(f["rollout"], f["train"], f["judge_s_per_image"], f["push_latency_s"])
    rows = [
        {
            "name": k,
            "published_s": VERL_OMNI_PHASES[k],
            "predicted_s": cal[k],
            "error": cal[k] / VERL_OMNI_PHASES[k] - 1,
            "kind": "predicted" if k in PREDICTED_PHASES else "input (read off the breakdown)",
        }
        for k in VERL_OMNI_PHASES
    ]
    step = sum(cal.values())
    n = next(iter(CALIBRATION.load_cluster().devices.values()))
    ips = CALIBRATION.workload().samples / (n * step)
    dg = digenrl_best(f)
    return {
        "efficiency": {
            "sampling": f["rollout"],
            "training": f["train"],
            "source": CALIBRATION.source,
            "half_tokens": CostParams().mfu_half_tokens_rollout,
        },
        "inputs": {"judge_s_per_image": f["judge_s_per_image"], "push_latency_s": f["push_latency_s"]},
        "phases": rows,
        "worst_predicted_phase_error": max(abs(r["error"]) for r in rows if r["kind"] == "predicted"),
        "step_s": {"published": CALIBRATION.published_step_s, "predicted": step},
        "images_per_gpu_s": {
            "published": CALIBRATION.published_images_per_gpu_s,
            "predicted": ips,
            "error": ips / CALIBRATION.published_images_per_gpu_s - 1,
        },
        "digenrl": {**dg, "speedup_vs_verl_omni": dg["images_per_gpu_s"] / ips},
        "out_of_sample": [predict(s, f) for s in OUT_OF_SAMPLE],
        "not_checked": list(NOT_CHECKED),
    }


def print_report(r: dict) -> None:
    e = r["efficiency"]
    print(
        f"fitted kernel efficiency: sampling {e['sampling']:.3f}, training {e['training']:.3f} "
        f"({e['source']})"
    )
    print(
        f"read off the breakdown: judge {r['inputs']['judge_s_per_image']:.3f} s/image, "
        f"push latency {r['inputs']['push_latency_s']:.2f} s"
    )
    print(f"{'phase':<16}{'published s':>12}{'predicted s':>12}{'error':>8}  kind")
    for p in r["phases"]:
        pub, pred = p["published_s"], p["predicted_s"]
        print(f"{p['name']:<16}{pub:>12.1f}{pred:>12.1f}{p['error']:>+8.1%}  {p['kind']}")
    s, i = r["step_s"], r["images_per_gpu_s"]
    print(f"step: published {s['published']:.0f} s, predicted {s['predicted']:.1f} s (phases only)")
    print(f"images/GPU/s: published {i['published']:.3f}, predicted {i['predicted']:.3f} ({i['error']:+.1%})")
    print(f"worst predicted phase: {r['worst_predicted_phase_error']:.1%}")
    d = r["digenrl"]
    print(
        f"DigenRL best plan on the same GPUs, same efficiencies: {d['label']}: {d['images_per_gpu_s']:.3f} "
        f"images/GPU/s ({d['speedup_vs_verl_omni']:.2f}x veRL-Omni as modelled)"
    )
    for o in r["out_of_sample"]:
        line = (
            f"out of sample: {o['name']}: published {o['published_step_s']:.0f} s/step, predicted "
            f"{o['predicted_step_s']:.0f} s ({o['step_error']:+.0%})"
        )
        if "published_images_per_gpu_s" in o:
            line += (
                f"; images/GPU/s {o['published_images_per_gpu_s']:.3f} vs "
                f"{o['predicted_images_per_gpu_s']:.3f} ({o['images_per_gpu_s_error']:+.0%})"
            )
        print(line)
        print(f"   phases: {o['phases']}" + (f"; {o['caveat']}" if o["caveat"] else ""))
    for line in r["not_checked"]:
        print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    r = report()
    print_report(r)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
