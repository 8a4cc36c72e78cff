"""benchmarks/gpu_calls.py (the GPU check's ``calls`` part, issue 51) and its fold: the shapes it runs are
the published ones, its real-width calls go through the diffusers classes (on the meta device, no
memory), a tiny run on the CPU writes every field the fold reads, and the fold's least squares give
back seconds-vs-batch lines known by hand. The GPU check's dry run (tests/test_benchmarks.py) runs the
part through benchmarks/gpu_smoke.sh."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import run_benchmark_here

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    """``benchmarks/<name>.py`` as a module (its functions, without running its main)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_calls, fold_gpu_check = _script("gpu_calls"), _script("fold_gpu_check")


def test_the_shapes_are_the_published_models_at_their_configs_token_counts():
    """By hand from the published config.json files: FLUX.1-dev 19 + 38 blocks of 24 x 128, 512 px =
    32 x 32 packed tokens + 512 T5 tokens; SD3.5-M 24 blocks of 24 x 64, 512 px = 32 x 32 patches +
    77 CLIP + 128 T5 tokens; Wan2.1-14B 40 blocks of 40 x 128, 240 x 416 x 33 frames = 9 x 15 x 26
    patches + 512 UMT5 tokens. Run: 2 double + 4 single, 4 and 2 blocks."""
    got = {f: gpu_calls.family_spec(f, tiny=False) for f in gpu_calls.FAMILIES}
    want = {
        "flux": (57, 6, 3072, 1024 + 512),
        "sd3": (24, 4, 1536, 1024 + 77 + 128),
        "wan": (40, 2, 5120, 3510 + 512),
    }
    half = {f: gpu_calls.family_spec(f, tiny=False, half=True)["blocks_run"] for f in want}
    assert half == {"flux": 3, "sd3": 2, "wan": 1}
    for family, (published, run, hidden, tokens) in want.items():
        s = got[family]
        assert (s["published_blocks"], s["blocks_run"], s["hidden"], s["tokens"]) == (
            published,
            run,
            hidden,
            tokens,
        )
    assert got["wan"]["image_tokens"] == 9 * 15 * 26 and got["flux"]["grid"] == (32, 32)


@pytest.mark.slow
def test_real_width_calls_run_through_the_diffusers_classes_on_the_meta_device():
    """Each family's inputs fit its real-width class (forward and backward shapes), with the dtypes the
    adapters pass: what the GPU run calls, checked without memory or FLOPs."""
    meta = torch.device("meta")
    for family in gpu_calls.FAMILIES:
        spec = gpu_calls.family_spec(family, tiny=False)
        model = gpu_calls.build(spec, meta, torch.bfloat16)
        kw = gpu_calls.inputs(family, spec, 2, meta, torch.bfloat16)
        out = model(**kw, return_dict=False)[0]
        assert out.shape == kw["hidden_states"].shape and out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_run_past_its_time_bound_skips_every_series_and_says_so(tmp_path):
    data = run_benchmark_here(
        "gpu_calls.py", tmp_path, "--tiny", "--device", "cpu", "--families", "wan", "--budget", "0"
    )
    assert data["rows"] == [] and data["errors"] == {} and data["ray_call"] is None
    assert data["skipped"] == ["wan/build", "wan/half/build", "ray_call"]  # no series of a model unbuilt


@pytest.mark.slow
def test_gpu_calls_tiny_run_with_a_ray_round_trip(tmp_path, ray_cluster):
    """Wan (the smallest), eager and compiled (dynamo without code generation), batch 1 and 2, and the
    round trip on the suite's Ray cluster: a row per mode, kind and batch, the fields the fold reads."""
    data = run_benchmark_here(
        "gpu_calls.py",
        tmp_path,
        *("--tiny", "--device", "cpu", "--families", "wan", "--batches", "1", "2", "--repeats", "1"),
        *("--compile-backend", "eager", "--ray-calls", "5"),
    )
    assert data["errors"] == {} and data["skipped"] == [] and data["tiny"] and data["gpu"] is None
    keys = {(r["mode"], r["kind"], r["batch"], r["blocks_run"]) for r in data["rows"]}
    kinds = ("forward", "train_step")
    want = {(m, k, b, 2) for m in ("eager", "compiled") for k in kinds for b in (1, 2)}
    assert keys == want | {("eager", k, b, 1) for k in kinds for b in (1, 2)}  # eager at half depth too
    assert all(r["median_s"] > 0 and r["warmup_s"] > 0 for r in data["rows"])
    wan = data["models"]["wan"]
    # the tiny preset: 2 heads x 12, 5 frames -> 2 latent frames x (32 px / 4 / 2)^2 patches + 16 text
    assert (wan["published_blocks"], wan["blocks_run"], wan["hidden"], wan["tokens"]) == (40, 2, 24, 32 + 16)
    assert wan["aten_ops_per_forward"] > 0 and wan["kernels_per_forward"] == {}  # counted on CUDA
    ray = data["ray_call"]
    assert ray["calls"] == 5 and 0 < ray["median_s"] <= ray["p90_s"] and not ray["started_here"]
    assert data["models"]["wan/half"]["blocks_run"] == 1
    costs = fold_gpu_check.call_costs(data)
    assert len(costs["rows"]) == 4 and costs["ray_call_s"] == ray["median_s"] and not costs["applies"]
    assert {r["blocks_run_half"] for r in costs["rows"] if r["mode"] == "eager"} == {1}


def test_fit_line_is_least_squares():
    """(1, 1), (2, 2), (4, 2): mean x 7/3, mean y 5/3, Sxy 4/3, Sxx 14/3 -> slope 2/7, intercept 1."""
    a, b = fold_gpu_check.fit_line([1, 2, 4], [1, 2, 2])
    assert a == pytest.approx(1.0) and b == pytest.approx(2 / 7)


def _row(family, mode, kind, batch, seconds, **shape):
    return {"family": family, "mode": mode, "kind": kind, "batch": batch, "median_s": seconds, **shape}


def test_call_costs_split_fixed_and_per_sample_seconds_into_per_block_and_the_rest(tmp_path):
    """FLUX-shaped eager forwards on the lines 12 ms + 3 ms x batch at 6 blocks and 7.5 ms + 1.8 ms x
    batch at 3: per block (12 - 7.5) / 3 = 1.5 ms fixed and (3 - 1.8) / 3 = 0.4 ms per sample, the
    rest 12 - 9 = 3 ms and 3 - 2.4 = 0.6 ms; at 57 blocks 3 + 85.5 = 88.5 ms and 0.6 + 22.8 = 23.4 ms.
    Kernels 600 and 330: 90 per block. Compiled train steps at one depth through (1, 1), (2, 2), (4, 2)
    s: the hand line 1 + 2/7 x batch, all of it per block (1/6 s), worst residual 2/7 (batch 1). A
    series of one batch has no slope and is left out."""
    shape = dict(published_blocks=57, hidden=3072, tokens=1536)
    rows = [
        _row("flux", "eager", "forward", b, 0.012 + 0.003 * b, blocks_run=6, **shape) for b in (1, 2, 4, 8)
    ]
    rows += [_row("flux", "eager", "forward", b, 0.0075 + 0.0018 * b, blocks_run=3, **shape) for b in (1, 16)]
    steps = ((1, 1.0), (2, 2.0), (4, 2.0))
    rows += [_row("flux", "compiled", "train_step", b, s, blocks_run=6, **shape) for b, s in steps]
    rows += [_row("flux", "compiled", "forward", 1, 0.01, blocks_run=6, **shape)]
    calls = {
        "device": "NVIDIA H200",
        "gpu": "H200",
        "tiny": False,
        "rows": rows,
        "models": {
            "flux": {"kernels_per_forward": {"eager": 600, "compiled": 200}, "aten_ops_per_forward": 1000},
            "flux/half": {"kernels_per_forward": {"eager": 330}, "aten_ops_per_forward": 550},
        },
        "ray_call": {"median_s": 0.0004},
        "skipped": ["wan/compiled/train_step/b16: time bound"],
    }
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    got = fold_gpu_check.fold(tmp_path)  # no dedicated.json: the call costs alone
    assert got["defaults"][0]["measured"] is None and not got["applies"]
    costs = got["call_costs"]
    assert costs["applies"] and costs["ray_call_s"] == 0.0004 and costs["skipped"] == calls["skipped"]
    by = {(r["mode"], r["kind"]): r for r in costs["rows"]}
    assert set(by) == {("eager", "forward"), ("compiled", "train_step")}
    fwd = by["eager", "forward"]
    assert (fwd["blocks_run"], fwd["blocks_run_half"], fwd["batches"]) == (6, 3, [1, 2, 4, 8])
    assert fwd["fixed_s"] == pytest.approx(0.012) and fwd["per_sample_s"] == pytest.approx(0.003)
    assert fwd["fixed_s_per_block"] == pytest.approx(0.0015)
    assert fwd["fixed_s_outside_blocks"] == pytest.approx(0.003)
    assert fwd["per_sample_s_per_block"] == pytest.approx(0.0004)
    assert fwd["per_sample_s_outside_blocks"] == pytest.approx(0.0006)
    assert fwd["published_fixed_s"] == pytest.approx(0.0885)
    assert fwd["published_per_sample_s"] == pytest.approx(0.0234)
    assert fwd["kernels_per_block"] == pytest.approx(90) and fwd["aten_ops_per_block"] == pytest.approx(150)
    assert fwd["fixed_s_per_kernel"] == pytest.approx(0.012 / 600) and fwd["max_rel_residual"] < 1e-9
    train = by["compiled", "train_step"]
    assert train["fixed_s"] == pytest.approx(1.0) and train["per_sample_s"] == pytest.approx(2 / 7)
    assert train["max_rel_residual"] == pytest.approx(2 / 7) and train["kernels_per_forward"] is None
    assert math.isclose(train["fixed_s_per_block"], 1 / 6) and train["fixed_s_outside_blocks"] is None
    assert train["published_fixed_s"] == pytest.approx(57 / 6) and train["blocks_run_half"] is None


def test_fold_without_any_measurement_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        fold_gpu_check.fold(tmp_path)
    assert exc.value.code == 2 and "neither dedicated.json nor calls.json" in capsys.readouterr().err


def test_op_and_event_counts_on_a_known_call():
    """What the rows' counts count, on a call whose ops are known: ``(x + 1).exp().view(-1)`` dispatches
    2 computing aten ops and 1 view; four ``add`` calls show as four aten::add profiler events (on CUDA
    the same helper counts the device's kernel events)."""
    x = torch.ones(3, 4)
    assert gpu_calls.aten_ops(lambda kw: (kw["x"] + 1).exp().view(-1), {"x": x}) == (2, 1)
    names = gpu_calls.profiled_events(lambda: [x.add(1) for _ in range(4)], kind="CPU")
    assert names.count("aten::add") == 4
