"""Fit the kernel efficiencies to veRL-Omni's published figures, check them out of sample, and say what
DigenRL's best plan predicts on the same GPUs with the same numbers.

    python benchmarks/peer_calibration.py [--json F]

What is fitted, what is read off, what is predicted (docs/scaling.md, "Calibration on published numbers"):

- fitted: the sampling curve -- peak efficiency AND the small-call falloff (``half``: tokens per call at
  half the peak) -- to TWO generation figures of one workload (serial vs request-level batching at
  max_num_seqs 32, docs/start/rollout_batching.md); the training efficiency to update_actor +
  old_log_prob of the published step (least squares in log error). They are the defaults of H100 /
  H800 / H200 in digenrl/planner/gpus.py and of ``CostParams.mfu_half_tokens_rollout``;
- read off the breakdown (inputs, not predictions): the reward judge's seconds per image (the reward
  phase / the images per GPU: a Qwen3-VL-8B served by vLLM that DigenRL does not model) and the fixed
  part of the weight push (update_weights - the modelled host/device moves);
- predicted: each phase (the published step's generation, serial, included), the step, images/GPU/s;
  and out of sample every other published row (:data:`~digenrl.planner.published.OUT_OF_SAMPLE`, their
  error printed whatever it is).

Runs in seconds on a CPU (the analytic cost model only; nothing is measured here).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from digenrl.planner import peer_verl_omni as verl
from digenrl.planner import peers as peer_models
from digenrl.planner.costmodel import CostModel
from digenrl.planner.params import CostParams
from digenrl.planner.published import (
    CALIBRATION,
    NOT_CHECKED,
    OUT_OF_SAMPLE,
    PREDICTED_PHASES,
    VERL_OMNI_GENERATION,
    VERL_OMNI_GENERATION_SOURCE,
    VERL_OMNI_PHASES,
)
from digenrl.planner.published_sd3 import VERL_OMNI_SD35_GENERATION
from digenrl.planner.published_setup import PublishedSetup
from digenrl.planner.search import search

#: the tolerances the fit must meet (tests/test_peer_calibration.py asserts them)
WORST_PHASE_TOLERANCE = 0.20
IMAGES_PER_GPU_TOLERANCE = 0.10


def _params(rollout: float, train: float, judge_s: float | None, half: float | None = None) -> CostParams:
    p = CostParams(mfu_rollout=rollout, mfu_train=train, mfu_source="fitted to veRL-Omni's published step")
    if half is not None:
        p.mfu_half_tokens_rollout = half
    if judge_s is not None:
        p.model_reward_s = judge_s
    return p


@functools.cache
def _calibration_setup():
    """The calibration's workload and cluster, read once: a fit evaluates ``phases`` thousands of times,
    and reading the config is nine tenths of one evaluation."""
    return CALIBRATION.workload(), CALIBRATION.load_cluster()


def _settings(setup: PublishedSetup, push_latency_s: float) -> verl.VerlOmniSettings:
    """veRL-Omni's published settings with the fitted push latency; a setup's own settings win (MM-GRPO
    has no server to reload: its push latency is 0)."""
    return replace(verl.PUBLISHED, **{"push_latency_s": push_latency_s, **setup.settings})


def phases(
    rollout: float,
    train: float,
    judge_s: float,
    push_latency_s: float,
    half: float | None = None,
    batch: int = 1,
) -> dict[str, float]:
    """veRL-Omni's step on the calibration setup, phase by phase, with these numbers (``batch``: the
    server's max_num_seqs; 1 = serial, as the published step ran)."""
    w, cluster = _calibration_setup()
    cost = CostModel(w, cluster, params=_params(rollout, train, judge_s, half))
    device, n = next(iter(cluster.devices.items()))
    s = replace(_settings(CALIBRATION, push_latency_s), server_batch=batch)
    return verl.verl_omni_phases(cost, device, n, s)


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


def _log_err(got: float, want: float) -> float:
    return math.log(got / want) ** 2


def fit() -> dict:
    """The sampling curve (peak, half) through both generation points, then the training efficiency,
    the judge's seconds per image and the push latency, fitted to the breakdown."""
    w, cluster = _calibration_setup()
    n = next(iter(cluster.devices.values()))
    judge_s = VERL_OMNI_PHASES["reward"] / (w.samples / n)
    (small, t_small), (large, t_large) = sorted(VERL_OMNI_GENERATION.items())

    def gen(r: float, half: float, batch: int) -> float:
        return phases(r, 0.3, judge_s, 0.0, half, batch)["generation"]

    def peak(half: float) -> float:  # the peak that puts the batched point exactly on the curve
        return golden(lambda r: _log_err(gen(r, half, large), t_large), 0.02, 0.95, 60)

    half = golden(lambda h: _log_err(gen(peak(h), h, small), t_small), 0.0, 20000.0, 60)
    rollout = peak(half)
    train = golden(
        lambda t: sum(
            _log_err(v, VERL_OMNI_PHASES[k])
            for k, v in phases(rollout, t, judge_s, 0.0, half).items()
            if k in PREDICTED_PHASES[1:]
        ),
        0.02,
        0.9,
    )
    moves = phases(rollout, train, judge_s, 0.0, half)["update_weights"]
    return {
        "rollout": rollout,
        "half_tokens_rollout": half,
        "train": train,
        "judge_s_per_image": judge_s,
        "push_latency_s": VERL_OMNI_PHASES["update_weights"] - moves,
    }


def generation_rows(f: dict) -> list[dict]:
    """Both generation points, published vs the fitted curve."""
    rows = []
    for batch, published in sorted(VERL_OMNI_GENERATION.items()):
        got = phases(f["rollout"], f["train"], f["judge_s_per_image"], 0.0, f["half_tokens_rollout"], batch)
        rows.append(
            {
                "max_num_seqs": batch,
                "published_s": published,
                "predicted_s": got["generation"],
                "error": got["generation"] / published - 1,
            }
        )
    return rows


def sd35_generation(f: dict) -> dict:
    """veRL-Omni's SD3.5 generation at both published max_num_seqs, predicted with the efficiencies fitted
    on Qwen-Image (out of sample: nothing refitted), as :func:`phases` predicts Qwen-Image's."""
    g = VERL_OMNI_SD35_GENERATION
    w, cluster = g.workload(), g.load_cluster()
    cost = CostModel(w, cluster, params=_params(f["rollout"], f["train"], None, f["half_tokens_rollout"]))
    device = next(iter(cluster.devices))
    rows = []
    for batch, published in sorted(g.points.items()):
        s = replace(verl.PUBLISHED, server_batch=batch)
        got = verl.verl_omni_phases(cost, device, g.gpus, s)["generation"]
        rows.append(
            {
                "max_num_seqs": batch,
                "images_per_forward": min(batch, w.samples // g.gpus),
                "published_s": published,
                "predicted_s": got,
                "error": got / published - 1,
            }
        )
    return {"name": g.name, "source": g.source, "caveat": g.caveat, "rows": rows}


def predict(setup: PublishedSetup, f: dict) -> dict:
    """The peer's predicted step on a published setup with the fitted numbers, against what was published."""
    w, cluster = setup.workload(), setup.load_cluster()
    judge = f["judge_s_per_image"] if setup.peer.startswith("verl_omni") else None
    cost = CostModel(w, cluster, params=_params(f["rollout"], f["train"], judge, f["half_tokens_rollout"]))
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
    params = _params(f["rollout"], f["train"], f["judge_s_per_image"], f["half_tokens_rollout"])
    cost = CostModel(w, cluster, params=params)
    res = search(cost, cluster, top=1)
    best = res.ranked[0]
    n = sum(cluster.devices.values())
    today = {  # every peer as it runs today on the same GPUs (veRL-Omni with its batching)
        name: {"where": r.where, "images_per_gpu_s": r.per_device_s, "iteration_s": r.iteration_s}
        for name, r in peer_models.peers(cost, cluster).items()
        if r.fits
    }
    return {
        "label": best.plan.label(),
        "images_per_gpu_s": best.samples_per_s / n,
        "iteration_s": best.iteration_s,
        "peers_today": today,
        "speedup_vs_fastest_peer_today": best.samples_per_s
        / n
        / max(r["images_per_gpu_s"] for r in today.values()),
        "note": "DigenRL's engine as built: rollout-only workers sample at engine.rollout_batch (auto: the "
        "largest batch the memory model fits; TAG / colocated workers in the trainer's micro-batch), "
        "the judge on the rollout devices at the same seconds per image",
    }


def report() -> dict:
    f = fit()
    cal = phases(
        f["rollout"], f["train"], f["judge_s_per_image"], f["push_latency_s"], f["half_tokens_rollout"]
    )
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
            "half_tokens": f["half_tokens_rollout"],
            "generation_source": VERL_OMNI_GENERATION_SOURCE,
        },
        "generation": generation_rows(f),
        "worst_generation_error": max(abs(r["error"]) for r in generation_rows(f)),
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
        "out_of_sample_generation": [sd35_generation(f)],
        "not_checked": list(NOT_CHECKED),
    }


def print_report(r: dict) -> None:
    e = r["efficiency"]
    print(
        f"fitted kernel efficiency: sampling {e['sampling']:.3f} (half at {e['half_tokens']:.0f} tokens per "
        f"call), training {e['training']:.3f} ({e['source']}; {e['generation_source']})"
    )
    for g in r["generation"]:
        print(
            f"generation at max_num_seqs {g['max_num_seqs']}: published {g['published_s']:.1f} s, "
            f"predicted {g['predicted_s']:.1f} s ({g['error']:+.1%})"
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
        f"images/GPU/s ({d['speedup_vs_verl_omni']:.2f}x veRL-Omni as published, serial)"
    )
    for name, p in d["peers_today"].items():
        print(
            f"   today: {name} ({p['where']}): {p['images_per_gpu_s']:.3f} images/GPU/s, "
            f"{p['iteration_s']:.0f} s/step (DigenRL {d['images_per_gpu_s'] / p['images_per_gpu_s']:.2f}x)"
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
    for g in r["out_of_sample_generation"]:
        for row in g["rows"]:
            print(
                f"out of sample: {g['name']} at max_num_seqs {row['max_num_seqs']} "
                f"({row['images_per_forward']} images per forward): published {row['published_s']:.1f} s, "
                f"predicted {row['predicted_s']:.1f} s ({row['error']:+.0%})"
            )
        print(f"   {g['caveat']}")
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
