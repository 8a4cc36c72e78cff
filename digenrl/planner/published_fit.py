"""One fit of the cost model's free parameters over every published row and DigenRL's own GPU rows.

The parameters (:data:`PARAMS`, fewer than the rows) and the rows (:func:`rows`) are named here; the
fit and its leave-one-out check are :mod:`digenrl.planner.loo`'s. Read off, not fitted: veRL-Omni's
judge seconds per image (its reward phase) and its push's fixed part (docs/scaling.md, "Calibration").
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

from digenrl.config.run import load_config
from digenrl.placement.devices import DEVICES
from digenrl.planner import loo
from digenrl.planner import peer_verl_omni as verl
from digenrl.planner import peers as peer_models
from digenrl.planner.call_times import AnalyticTimes
from digenrl.planner.costmodel import CostModel
from digenrl.planner.judge import QWEN25_VL_3B_OCR
from digenrl.planner.loo import Param, Row, Theta
from digenrl.planner.params import CostParams
from digenrl.planner.published import CALIBRATION, OUT_OF_SAMPLE, VERL_OMNI_GENERATION, VERL_OMNI_PHASES
from digenrl.planner.published_sd3 import VERL_OMNI_SD35_GENERATION
from digenrl.planner.published_setup import PublishedSetup
from digenrl.planner.search import search
from digenrl.planner.shapes import model_shape, param_counts
from digenrl.planner.uncertainty import fits
from digenrl.planner.workload import Workload

ROOT = Path(__file__).resolve().parents[2]
H200_RUN = "benchmarks/gpu_runs/2026-12-04-h200"

PARAMS = [
    Param("mfu_rollout", 0.45, 0.05, 0.95, "share of peak bf16 FLOP/s a sampling forward's matmuls reach"),
    Param("mfu_train", 0.35, 0.05, 0.95, "... a training forward + backward's"),
    Param(
        "op_launch_s", 1.2e-5, 1e-6, 2e-4, "seconds per kernel of an eager transformer call (op_counts.py)"
    ),
    Param("dispatch_s_per_worker", 0.3, 1e-3, 10.0, "a single controller's step seconds per worker"),
    Param("serve_seq_step_s", 1e-4, 1e-7, 1e-2, "a VLM judge server's host work per request and decode step"),
]


def cost_params(theta: Theta, judge_s: float | None = None) -> CostParams:
    """The cost model's parameters with ``theta``; the efficiency falloff is off (the fixed terms
    replace it)."""
    p = CostParams(
        mfu_rollout=theta["mfu_rollout"],
        mfu_train=theta["mfu_train"],
        mfu_source="fitted on every published row (planner/published_fit.py)",
        mfu_half_tokens_rollout=0.0,
        mfu_half_tokens_train=0.0,
        op_launch_s=theta["op_launch_s"],
        dispatch_s_per_worker=theta["dispatch_s_per_worker"],
        serve_seq_step_s=theta["serve_seq_step_s"],
    )
    if judge_s is not None:
        p.model_reward_s = judge_s
    return p


_SETUPS: dict[str, tuple] = {}


def _setup(setup) -> tuple:
    """(workload, cluster) of a published setup, read once (reading a config is most of an evaluation)."""
    if setup.name not in _SETUPS:
        _SETUPS[setup.name] = setup.workload(), setup.load_cluster()
    return _SETUPS[setup.name]


def judge_s_per_image() -> float:
    """veRL-Omni's Qwen-Image judge, read off its reward phase: seconds per image on one GPU."""
    w, cluster = _setup(CALIBRATION)
    return VERL_OMNI_PHASES["reward"] / (w.samples / next(iter(cluster.devices.values())))


def settings(setup: PublishedSetup, push_latency_s: float) -> verl.VerlOmniSettings:
    """veRL-Omni's published settings with the read-off push latency; a setup's own settings win."""
    return replace(verl.PUBLISHED, **{"push_latency_s": push_latency_s, **setup.settings})


def calibration_phases(theta: Theta, batch: int = 1, push_latency_s: float = 0.0) -> dict[str, float]:
    """veRL-Omni's Qwen-Image LoRA step on 4xH800, phase by phase (``batch``: max_num_seqs)."""
    w, cluster = _setup(CALIBRATION)
    cost = CostModel(w, cluster, params=cost_params(theta, judge_s_per_image()))
    device, n = next(iter(cluster.devices.items()))
    return verl.verl_omni_phases(
        cost, device, n, replace(settings(CALIBRATION, push_latency_s), server_batch=batch)
    )


def push_latency_s(theta: Theta) -> float:
    """The push's fixed part: the published update_weights less the modelled moves."""
    return VERL_OMNI_PHASES["update_weights"] - calibration_phases(theta)["update_weights"]


def peer_run(setup: PublishedSetup, theta: Theta):
    """The peer's modelled step on a published setup."""
    w, cluster = _setup(setup)
    judge = judge_s_per_image() if setup.peer.startswith("verl_omni") else None
    cost = CostModel(w, cluster, params=cost_params(theta, judge))
    model = peer_models.MODELS[setup.peer]
    if setup.peer.startswith("verl"):
        return model(cost, cluster, settings(setup, push_latency_s(theta)))
    return model(cost, cluster)


def sd35_generation(theta: Theta, batch: int) -> float:
    g = VERL_OMNI_SD35_GENERATION
    w, cluster = _setup(g)
    # the judge: GenRM-OCR on a 3rd GPU, streamed into the gen timer (enable_resource_pool=True, script
    # :97), at the GPU-seconds per image read off the Qwen-Image OCR judge (not fitted on these rows)
    cost = CostModel(w, cluster, params=cost_params(theta, judge_s_per_image()))
    s = replace(verl.PUBLISHED, server_batch=batch, judge_streamed_gpus=1)
    return verl.verl_omni_phases(cost, next(iter(cluster.devices)), g.gpus, s)["generation"]


def h200_workload():
    """The H200 check's sampler model: FLUX.1 width, 2 double + 4 single blocks, 1536 tokens, bf16."""
    over = ("model.height=512", "model.width=512", "model.max_text_len=512")
    config = model_shape(load_config(ROOT / "configs" / "flux1_dev.yaml", list(over)).model).config
    blocks = json.dumps({**config, "num_layers": 2, "num_single_layers": 4}, sort_keys=True)
    return reduced_workload("configs/flux1_dev.yaml", blocks, over)


def h200_times(theta: Theta) -> AnalyticTimes:
    return AnalyticTimes(h200_workload(), DEVICES["H200"], cost_params(theta))


def _memo(fn):
    """Cache on the parameter values (a fit evaluates every row at one theta)."""
    seen: dict = {}

    def wrapped(theta: Theta, *args):
        key = (tuple(sorted(theta.items())), args)
        if key not in seen:
            if len(seen) > 4096:
                seen.clear()
            seen[key] = fn(theta, *args)
        return seen[key]

    return wrapped


_cal = _memo(calibration_phases)
_peer = _memo(lambda theta, i: peer_run(OUT_OF_SAMPLE[i], theta).iteration_s)


def rows() -> list[Row]:
    """Every published row the model predicts (kind "peer" or "bound") and DigenRL's own H200 rows."""
    cal = CALIBRATION.source
    out = [
        Row(
            f"veRL-Omni Qwen-Image LoRA 4xH800: generation at max_num_seqs {b}",
            "qwen_lora_4xh800",
            s,
            lambda t, b=b: _cal(t, b)["generation"],
            source="verl-omni docs/start/rollout_batching.md:131",
        )
        for b, s in sorted(VERL_OMNI_GENERATION.items())
    ]
    out += [
        Row(
            f"veRL-Omni Qwen-Image LoRA 4xH800: {k}",
            "qwen_lora_4xh800",
            VERL_OMNI_PHASES[k],
            lambda t, k=k: _cal(t, 1)[k],
            source=cal,
        )
        for k in ("update_actor", "old_log_prob")
    ]
    for i, s in enumerate(OUT_OF_SAMPLE):
        kind = "bound" if s.peer == "dancegrpo" else "peer"
        out.append(Row(s.name, s.name, s.published_step_s, lambda t, i=i: _peer(t, i), kind, s.source))
    g = VERL_OMNI_SD35_GENERATION
    out += [
        Row(
            f"{g.name}: max_num_seqs {b}",
            "verl_omni_sd35_generation",
            s,
            lambda t, b=b: sd35_generation(t, b),
            source=g.source,
        )
        for b, s in sorted(g.points.items())
    ]
    out += own_rows()
    return out


def call_rows(path: Path) -> list[Row]:
    """The GPU check's eager call times (``benchmarks/gpu_calls.py``'s calls.json of a GPU run): one row
    per family, kind and batch, predicted for the same blocks, tokens and device; a family's curve
    leaves the fit together. None from a CPU or tiny run."""
    data = json.loads(path.read_text())
    if not data.get("gpu") or data.get("tiny") or data["gpu"] not in DEVICES:
        return []
    out = []
    for r in data["rows"]:
        model = next(
            (
                m
                for m in data["models"].values()
                if m["family"] == r["family"] and m["blocks_run"] == r["blocks_run"]
            ),
            None,
        )
        if r["mode"] != "eager" or model is None:
            continue
        w = reduced_workload(model["config_file"], json.dumps(model["config"], sort_keys=True))
        kind, b = r["kind"], r["batch"]
        where = f"{path.parent.name}/{path.name}"
        out.append(
            Row(
                f"DigenRL {data['gpu']} {r['family']} {r['blocks_run']} blocks, {kind}, batch {b}",
                f"{where}:{r['family']}:{kind}",
                r["median_s"],
                lambda t, w=w, g=data["gpu"], kind=kind, b=b: _call_s(t, w, g, kind, b),
                "own",
                where,
            )
        )
    return out


@functools.cache
def reduced_workload(config_file: str, config_json: str, overrides: tuple[str, ...] = ()):
    """The workload of ``config_file`` (+ ``overrides``) with its transformer's config replaced (fewer
    blocks): one pass, full weights, bf16 -- a GPU check's model."""
    w = Workload.from_config(load_config(ROOT / config_file, ["model.lora=null", *overrides]))
    shape = replace(w.shape, config=json.loads(config_json))
    shape.tokens = w.shape.tokens
    return replace(w, shape=shape, params=param_counts(shape, None, ()), passes=1, lora=False, kl=False)


def _call_s(theta: Theta, w, gpu: str, kind: str, b: int) -> float:
    t = AnalyticTimes(w, DEVICES[gpu], cost_params(theta))
    return t.rollout_step(b) if kind == "forward" else t.train_step(b)


def own_rows() -> list[Row]:
    """DigenRL's measured GPU rows: the H200 check's sampler step at each batch and train step at batch
    4, and every GPU run's eager call times (benchmarks/gpu_runs/*/calls.json)."""
    run = ROOT / H200_RUN
    curve = json.loads((run / "dedicated.json").read_text())["rollout_batch_curve"]
    train = json.loads((run / "realwidth.json").read_text())["train_ac_off"]
    out = [
        Row(
            f"DigenRL H200 sampler step, batch {b}",
            f"h200_sampler_{b}",
            v["step_s"],
            lambda t, b=int(b): h200_times(t).rollout_step(b),
            "own",
            f"{H200_RUN}/dedicated.json",
        )
        for b, v in curve.items()
    ]
    b = train.get("batch", 4)
    out.append(
        Row(
            f"DigenRL H200 train step, batch {b}",
            "h200_train",
            train["step_s"],
            lambda t: h200_times(t).train_step(b),
            "own",
            f"{H200_RUN}/realwidth.json",
        )
    )
    for calls in sorted((ROOT / "benchmarks" / "gpu_runs").glob("*/calls.json")):
        out += call_rows(calls)
    return out


def sd35_judge_readings(theta: Theta) -> dict[str, float]:
    """What the SD3.5 rows' judge (GenRM-OCR on Qwen2.5-VL-3B, planner/judge.py) adds to generation
    under two readings of its answers, and the generation the model prices without it."""
    judge = QWEN25_VL_3B_OCR
    g = VERL_OMNI_SD35_GENERATION
    w, cluster = _setup(g)
    dev, px, p = DEVICES[next(iter(cluster.devices))], w.shape.tokens.pixels, cost_params(theta)
    tokens = judge.input_tokens(px)
    eff = p.mem_bw_efficiency
    step = judge.decode_step_s(
        w.samples, tokens + judge.answer_tokens / 2, dev, p.mfu_rollout, eff, p.serve_seq_step_s
    )
    cost = CostModel(w, cluster, params=cost_params(theta, 0.0))
    bare = {
        b: verl.verl_omni_phases(
            cost, next(iter(cluster.devices)), g.gpus, replace(verl.PUBLISHED, server_batch=b)
        )
        for b in g.points
    }
    return {
        **{f"generation_{b}": v["generation"] for b, v in bare.items()},
        "short": judge.prefill_s(w.samples, px, dev, p.mfu_rollout) + judge.answer_tokens * step,
        "runaway": 4096 * judge.decode_step_s(1, tokens + 2048, dev, p.mfu_rollout, eff, p.serve_seq_step_s),
    }


def outside(theta: Theta) -> dict[str, str]:
    """Why a row stays outside the leave-one-out bound, with the evidence (benchmarks/peer_calibration.py)."""
    r = sd35_judge_readings(theta)
    points = VERL_OMNI_SD35_GENERATION.points
    gen = " / ".join(f"{r[f'generation_{b}']:.1f}" for b in points)
    beyond = " / ".join(f"{v - r[f'generation_{b}']:.1f}" for b, v in points.items())
    return {
        "veRL-Omni SD3.5-M": "judge-bound, the judge unmeasured: every image's GenRM-OCR request (genrm_ocr"
        ".py: max_tokens 4096, temperature 0.7) to Qwen2.5-VL-3B at TP 1 is awaited inside the gen timer, "
        "priced at the 0.227 s per image read off the Qwen-Image reward phase (Qwen3-VL-8B at TP 4). "
        f"Without it the model's generation is {gen} s (serial / batched), and the rows carry {beyond} s "
        f"beyond it; from the judge's architecture (planner/judge.py) 64 short transcriptions add "
        f"{r['short']:.1f} s, one answer that runs to max_tokens {r['runaway']:.1f} s. Decides it: the "
        "judge's response lengths (genrm_response, logged per "
        "image) or its time on one H800",
    }


def report(loo_fits: bool = True) -> dict:
    """The fit over every row, each row's in-sample and leave-one-out error, and the summaries."""
    table_rows = rows()
    full = loo.fit(PARAMS, table_rows)
    held = loo.leave_one_out(PARAMS, table_rows, full) if loo_fits else {r.group: full for r in table_rows}
    return _report(table_rows, full, held)


def _report(table_rows: list[Row], full: Theta, held: dict[str, Theta]) -> dict:
    table = loo.errors(table_rows, full, held)
    notes = outside(full)
    for t in table:
        why = next((v for k, v in notes.items() if t["name"].startswith(k)), None)
        if why and abs(t["loo_error"]) > 0.30:
            t["outside"] = why
    return {
        "params": [{"name": p.name, "value": full[p.name], "what": p.what} for p in PARAMS],
        "read_off": {"judge_s_per_image": judge_s_per_image(), "push_latency_s": push_latency_s(full)},
        "rows": table,
        "peers": loo.summary(table, "peer"),
        "own": loo.summary(table, "own"),
        "fits": {"all": full, **held},
    }


def ratios(fits: dict[str, Theta]) -> dict:
    """DigenRL's best plan vs each peer as it runs today on the calibration's GPUs (4xH800), under each
    fit: the ratio of images per GPU-second, its value under the fit of all rows and its range over
    the leave-one-out fits."""
    w, cluster = _setup(CALIBRATION)
    per_fit: dict[str, dict[str, float]] = {}
    for name, theta in fits.items():
        cost = CostModel(w, cluster, params=cost_params(theta, judge_s_per_image()))
        best = search(cost, cluster, top=1).ranked[0].samples_per_s
        per_fit[name] = {
            peer: best / r.samples_per_s for peer, r in peer_models.peers(cost, cluster).items() if r.fits
        }
    peers = per_fit["all"]
    held = [v for k, v in per_fit.items() if k != "all"]
    return {
        peer: {"all": peers[peer], "min": min(h[peer] for h in held), "max": max(h[peer] for h in held)}
        for peer in peers
    }


def shipped_table() -> dict:
    """:func:`report` from the shipped fits (planner/cost_fit.json): no fitting, every row evaluated under
    the fit of all rows and the fit that left its group out."""
    f = fits()
    full, held = f["all"], f["leave_one_out"]
    return _report(rows(), full, held)
