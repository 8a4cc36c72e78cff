"""Every script in benchmarks/ runs at a tiny size (1-3 iterations) and writes the JSON fields its
readers use, so a change elsewhere cannot break one silently. Smoke runs only: no number is judged
(speed lives in the benchmarks themselves). Each runs as a user runs it (``python benchmarks/X.py
ARGS``): as its own process where it starts Ray or processes of its own, else as its ``__main__``
inside the suite's process (``tests.helpers.run_benchmark_here``): a script whose engine runs need
only logical devices on the suite's Ray cluster with its warm workers, a single-process one (memory,
minibatch_ppo, stale_gradient, gpu_realwidth on the CPU) without the ~5 s of CPU a fresh interpreter
spends importing torch and diffusers."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TINY_IMAGE, run_benchmark_here

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run_script(name: str, tmp_path: Path, *args: str, timeout: int = 600) -> dict:
    """Run ``benchmarks/<name>`` with ``args`` and ``--json``; returns the JSON it wrote."""
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(BENCH / name), *args, "--json", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def bench_module(name: str):
    """``benchmarks/<name>.py`` imported as a module (its functions, without running its main)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def test_every_benchmark_has_a_smoke_test():
    """Each script under benchmarks/ is run by some test (here, or a test file of its own)."""
    here = "".join(t.read_text() for t in Path(__file__).parent.glob("test_*.py"))
    scripts = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))
    assert scripts and [s for s in scripts if f'"{s}"' not in here] == []


def test_a_benchmark_that_imports_the_tests_puts_the_repo_on_its_path():
    """``python benchmarks/X.py`` puts only benchmarks/ on sys.path, and ``tests`` is not installed: a
    script importing it must insert the repo root itself (the suite's runs set PYTHONPATH, a user's
    do not: learning.py failed with ModuleNotFoundError)."""
    for script in sorted(BENCH.glob("*.py")):
        text = script.read_text()
        if re.search(r"^\s*(from tests[ .]|import tests)", text, re.M):
            inserts = ("sys.path.insert(0, str(ROOT))", "sys.path.insert(0, str(Path(__file__)")
            assert any(i in text for i in inserts), f"benchmarks/{script.name}: no root on sys.path"


@pytest.mark.slow
def test_engine_modes(tmp_path, ray_cluster):
    """The colocated_batch workload: colocated at the trainer's batches, then at a unit per forward
    (engine.colocated_batch), side by side in one run, and the ratio of the two."""
    data = run_benchmark_here(
        "engine_modes.py", tmp_path, "--tiny", "--iterations", "3", "--workload", "colocated_batch"
    )
    rows = data["modes"]
    assert [r["mode"] for r in rows] == ["trainer_batches", "unit_batch"]
    for row in rows:
        assert row["samples_per_s"] > 0 and 0 <= row["bubble_fraction"] <= 1
        assert finite(row["iteration_s"], row["bound_s"], row["efficiency"], row["sync_s"])
    ratio = data["vs_first_mode"]["colocated_batch"]
    assert ratio["trainer_batches"] == 1.0
    assert ratio["unit_batch"] == pytest.approx(rows[1]["samples_per_s"] / rows[0]["samples_per_s"])


@pytest.mark.slow
def test_engine_modes_kl_reference(tmp_path, ray_cluster):
    """The kl_reference workload: the KL reference's forward in the train unit, then at rollout, side
    by side in one run: the ratios of samples/s and of the train units' seconds, and each
    side's reference forwards (all on the trainer, then all on the rollout worker)."""
    data = run_benchmark_here(
        "engine_modes.py", tmp_path, "--tiny", "--iterations", "3", "--workload", "kl_reference"
    )
    train, rollout = data["modes"]
    assert (train["mode"], rollout["mode"]) == ("train", "rollout")
    assert train["ref_forwards_train"] > 0 and train["ref_forwards_rollout"] == 0
    assert rollout["ref_forwards_rollout"] > 0 and rollout["ref_forwards_train"] == 0
    units = data["vs_first_mode_train_unit_s"]["kl_reference"]
    assert units["train"] == 1.0
    assert units["rollout"] == pytest.approx(rollout["train_unit_s_median"] / train["train_unit_s_median"])
    assert data["vs_first_mode"]["kl_reference"]["rollout"] > 0


@pytest.mark.slow
def test_plan_fidelity(tmp_path, ray_cluster):
    """It ran into a TypeError after the simulator's cost interface changed (and nothing noticed)."""
    data = run_benchmark_here(
        "plan_fidelity.py", tmp_path, "--tiny", "--iterations", "3", "--modes", "sync", "--calibration", "ray"
    )
    (row,) = data["modes"]
    assert row["mode"] == "sync" and row["measured_samples_per_s"] > 0 and row["predicted_samples_per_s"] > 0
    assert finite(row["rel_error"], row["replay_rel_error"], row["predicted_bubble_fraction"])
    assert data["iterations"] == 3 and data["profile_engine"]["source"]


def test_plan_fidelity_table_compares_medians():
    """Per mode, the median prediction against the median measurement (not the median of the
    runs' errors), in the order the modes ran; by hand for three runs of one mode and one of another."""
    import runpy

    table = runpy.run_path(str(BENCH / "fidelity_table.py"))
    keys = ["bubble_fraction", "replay_rel_error", "at_run_load_samples_per_s", "other_load_cores"]

    def run(pred, meas, **kw):
        r = {"predicted_samples_per_s": pred, "measured_samples_per_s": meas, "other_runnable": 0.0}
        r |= {f"predicted_{keys[0]}": 0.1, f"measured_{keys[0]}": 0.2} | dict.fromkeys(keys[1:], 1.0)
        return r | kw

    runs = {
        "sync": [run(10.0, 8.0), run(12.0, 10.0, at_run_load_samples_per_s=4.0), run(11.0, 12.0)],
        "gap": [run(6.0, 5.0, replay_rel_error=-0.5)],
    }
    sync, gap = table["mode_rows"](runs)
    assert (sync["mode"], gap["mode"]) == ("sync", "gap") and sync["runs"] == runs["sync"]
    assert (sync["predicted_samples_per_s"], sync["measured_samples_per_s"]) == (11.0, 10.0)
    assert sync["rel_error"] == pytest.approx(0.1)  # (11 - 10) / 10, where the runs' errors' median is 0.2
    assert sync["at_run_load_samples_per_s"] == 1.0 and sync["at_run_load_rel_error"] == pytest.approx(-0.9)
    assert gap["rel_error"] == pytest.approx(0.2) and gap["replay_rel_error"] == -0.5


@pytest.mark.slow
def test_reward_overlap(tmp_path, ray_cluster):
    tiny = ["train.prompts_per_iteration=2", "sampling.steps=2"]  # 2 units of 4 samples per iteration
    sets = [arg for kv in tiny for arg in ("--set", kv)]
    data = run_benchmark_here(
        "reward_overlap.py", tmp_path, "--iterations", "3", "--clip-size", "32", "--clip-layers", "1", *sets
    )
    assert set(data) == {"inline", "service"}
    for mode in data.values():
        assert mode["samples_per_s"] > 0 and len(mode["all_samples_per_s"]) == 1
    assert 0 <= data["service"]["reward_overlapped_generation"] <= 1


@pytest.mark.slow
def test_soak(tmp_path, ray_cluster):
    """The script's fields on a run without faults; the kills and their books are
    tests/test_faults.py's (the same engine path: a killed rollout worker restarted, its unit made
    again, nothing lost or trained twice) and the fault plan is checked below."""
    data = run_benchmark_here(
        "soak.py",
        tmp_path,
        "--iterations",
        "2",
        "--fault-rate",
        "0",
        "--rollout-workers",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert data["iterations"] == 2 and data["lost"] == 0 and data["duplicated"] == 0
    assert data["units_with_a_fault"] == data["restarts"] == data["rollouts_generated_again"] == 0
    assert finite(data["samples_per_s"], data["longest_stall_s"])


def test_soak_fault_plan():
    """Each planned unit kills every rollout worker that may run it, or (with the reward service,
    about half the time) the reward actor while it scores; the same seed gives the same plan."""
    soak = bench_module("soak")
    plan = soak.fault_list(40, 4, 2, 0.3, 0, reward_service=False)
    units = {u for _, u in plan}
    assert 0 < len(units) < 160 and plan == soak.fault_list(40, 4, 2, 0.3, 0, reward_service=False)
    assert sorted(plan) == sorted((f"rollout{i}", u) for u in units for i in range(2))
    served = soak.fault_list(40, 4, 2, 0.3, 0, reward_service=True)
    assert {w for w, _ in served} == {"reward", "rollout0", "rollout1"}
    assert soak.fault_list(40, 4, 2, 0.0, 0, reward_service=False) == []


@pytest.mark.slow
def test_weight_sync(tmp_path):
    rows = run_script("weight_sync.py", tmp_path, "--repeats", "1", "--lora-mib", "1", "--full-mib", "4")[
        "rows"
    ]
    assert {"ray_object_store", "broadcast_gloo", "agree_sha256", "agree_fingerprint"} <= {
        r["transport"] for r in rows
    }
    assert all(r["bytes"] > 0 and r["bytes_per_s"] > 0 for r in rows)


@pytest.mark.slow
def test_warm_workers(tmp_path):
    """One run cold and warm (its reuse is tests/test_warm.py's): the fields the table reads."""
    data = run_script("warm_workers.py", tmp_path, "--repeats", "1", "--runs", "sync")
    (row,) = data["runs"]
    assert row["run"] == "sync" and (row["reused"], row["started"]) == (0, 2) and data["repeats"] == 1
    assert finite(row["cold_s"], row["warm_s"], data["total_cold_s"], data["total_warm_s"])


@pytest.mark.slow
def test_memory(tmp_path):
    rows = run_benchmark_here("memory.py", tmp_path, "--configs", str(ROOT / "configs" / "flux_tiny.yaml"))[
        "rows"
    ]
    assert {r["config"] for r in rows} == {"flux_tiny.yaml"} and len(rows) >= 4
    assert all(finite(r["predicted_gib"], r["measured_gib"]) for r in rows)
    weights = next(r for r in rows if r["component"].startswith("weights"))
    assert weights["measured_gib"] > 0


@pytest.mark.slow
def test_gpu_realwidth(tmp_path):
    small = ["--double", "1", "--single", "1", "--batch", "1", "--steps", "2"]
    data = run_benchmark_here("gpu_realwidth.py", tmp_path, "--tiny", "--device", "cpu", *small)
    assert data["device"] == "cpu" and data["params"] > 0
    assert data["rollout"]["step_s"] > 0 and data["train_ac_off"]["step_s"] > 0
    assert finite(data["on_policy"]["max_abs_log_ratio"]) and data["weight_sync"]
    assert data["rollout"]["host_syncs"] is None  # counted on CUDA only


def test_gpu_realwidth_counts_the_warnings_of_synchronizing_calls_and_nothing_else():
    """What torch's sync debug mode raises on CUDA ("called a synchronizing CUDA operation"), counted
    without CUDA: the helper keeps those warnings' first lines and drops the rest."""
    import warnings

    synchronizing_warnings = bench_module("gpu_realwidth").synchronizing_warnings

    def step():
        warnings.warn("called a synchronizing CUDA operation\n  (the stack)", UserWarning)
        warnings.warn("called a synchronizing CUDA operation\n  (the stack)", UserWarning)
        warnings.warn("Mismatch dtype between input and weight", UserWarning)

    assert synchronizing_warnings(step) == ["called a synchronizing CUDA operation"] * 2


@pytest.mark.slow
def test_minibatch_ppo(tmp_path):
    tiny = [
        *TINY_IMAGE,
        "sampling.steps=3",
        "algorithm.group_size=4",
        "train.prompts_per_iteration=2",
    ]
    sets = [arg for kv in tiny for arg in ("--set", kv)]
    data = run_benchmark_here(
        "minibatch_ppo.py", tmp_path, "--steps", "1", "2", "--seeds", "0", "--iterations", "2", *sets
    )
    assert set(data["summary"]) == {"1", "2"} and [len(r["rows"]) for r in data["runs"]] == [2, 2]
    for row in data["summary"].values():
        assert finite(row["clip_frac"], row["ratio_min"], row["ratio_max"], row["cpu_s_per_iteration"])


def test_peer_calibration_is_smoked_by_the_peer_tests():
    """benchmarks/peer_calibration.py is analytic (seconds, no process of its own needed): its main()
    writes the JSON that tests/test_peers.py reads, every field this smoke test read included."""
    peers = (ROOT / "tests" / "test_peers.py").read_text()
    assert '"peer_calibration.py"' in peers and 'peer_calibration.main(["--json"' in peers


@pytest.mark.slow
def test_colour_margin(tmp_path):
    """Two iterations of the tiny FLUX.2; the paired red / blue margin before and after."""
    sets = [arg for kv in [*TINY_IMAGE, "sampling.steps=2", "sampling.eval_steps=2"] for arg in ("--set", kv)]
    cfg = str(ROOT / "configs" / "flux2_tiny.yaml")
    data = run_benchmark_here(
        "colour_margin.py", tmp_path, "-c", cfg, "--seeds", "0", "--iterations", "2", *sets
    )
    (r,) = data["runs"]
    assert len(r["rewards"]) == 2 and finite(r["gain"], r["noise"])
    assert all(finite(*r[k].values()) for k in ("before", "after"))


def test_colour_capacity_steps_the_margin_up():
    """ "colour_capacity.py" (benchmarks/) in-process on the tiny FLUX.2 at 16 x 16: the prompt's share of
    the velocity, and one Adam step on the supervised colour margin raises it (the gradient reaches the
    LoRA through the prompt's path)."""
    r = bench_module("colour_capacity").run(ROOT / "configs" / "flux2_tiny.yaml", 1, 1e-2, TINY_IMAGE)
    assert all(0 < s < 1 for s in r["prompt_share"])
    before, after = r["margins"]
    assert abs(before) < 2**0.5 and after > before


@pytest.mark.slow
def test_stale_gradient(tmp_path):
    """Every variant trains 2 iterations; a stale variant's probe splits the gradient per trained step."""
    tiny = [*TINY_IMAGE, "sampling.steps=3"]
    sets = [arg for kv in tiny for arg in ("--set", kv)]
    data = run_benchmark_here(
        "stale_gradient.py", tmp_path, "--iterations", "2", "--seeds", "0", "--probe_every", "1", *sets
    )
    assert [r["variant"] for r in data["runs"]] == ["on_policy", "stale_raw", "stale_recentred"]
    for r in data["runs"]:
        assert finite(r["gain"], r["grad_norm_mean"]) and len(r["rewards"]) == 2
    probed = [r for r in data["runs"] if r["probes"]]
    assert probed and all(finite(s["score"], s["drift"]) for r in probed for s in r["probes"][0]["steps"])


@pytest.mark.slow
def test_algorithms(tmp_path, ray_cluster):
    """The script's own default mode (full) with DiffusionNFT, 2 iterations: Flow-GRPO at the full mode
    through the same benchmarks/learning.py loop is tests/test_learning_bench.py's tiny run."""
    tiny = [*TINY_IMAGE, "sampling.steps=3", "algorithm.group_size=4"]
    sets = [arg for kv in tiny for arg in ("--set", kv)]
    data = run_benchmark_here("algorithms.py", tmp_path, "--tiny", "--algorithms", "diffusion_nft", *sets)
    names = [(r["mode"], r["algorithm"], r["iterations"]) for r in data["runs"]]
    assert names == [("full", "diffusion_nft", 2)] and not data["skipped"]
    assert all(finite(r["gain"], r["samples_per_s"]) for r in data["runs"])


def test_learning_is_smoked_by_its_own_tests():
    """benchmarks/learning.py's --tiny run and its statistics are tested in tests/test_learning_bench.py."""
    assert '"learning.py"' in (ROOT / "tests" / "test_learning_bench.py").read_text()


def test_reward_server_is_exercised_by_the_remote_reward_tests():
    """benchmarks/reward_server.py is the example server tests/test_remote_reward.py runs."""
    assert '"reward_server.py"' in (ROOT / "tests" / "test_remote_reward.py").read_text()


@pytest.mark.slow
def test_gpu_smoke_dry_run_on_cpu(tmp_path):
    """``DEVICE=cpu`` runs the GPU check's measuring parts at tiny sizes ("gpu_dedicated.py", then
    "fold_gpu_check.py"): every JSON field the fold reads is there, and the fold names the defaults;
    the one-rank FSDP2 dtype check ("gpu_fsdp_dtype.py"), issue 53's checks ("gpu_ready.py"), the train
    step's variants
    ("gpu_train_variants.py": here only fp32 masters with model.cudnn_attention on) and the
    two-processes-one-device run pass; the call costs ("gpu_calls.py", eager) fold per family and kind."""
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "PARTS": "dedicated train_variants fsdp_dtype gpu_ready calls fold shared",
        "PYTHON": sys.executable,
    }
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_smoke.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dedicated: ok" in done.stdout and "fold: ok" in done.stdout
    # one FSDP2 rank in bf16: inputs and rotary tables keep their dtypes, sharded == unsharded
    dtype = json.loads((tmp_path / "fsdp_dtype.json").read_text())
    assert dtype["ok"] and dtype["equal"] and dtype["rotary_dtypes"] == ["torch.float32"]
    assert dtype["root_inputs_unchanged"] and dtype["velocity_scale"] > 0
    # issue 53: bf16 timesteps as the pipelines pass them; Wan2.2's experts the same on both shares
    ready = json.loads((tmp_path / "gpu_ready.json").read_text())
    assert ready["ok"] and ready["timesteps"] == {"flux": "ok", "wan22": "ok"}, ready["timesteps"]
    assert ready["collectives"]["equal"] and ready["collectives"]["share0"][:2] == [
        ["forward", "transformer"],
        ["forward", "transformer_2"],
    ]
    variants = json.loads((tmp_path / "train_variants.json").read_text())
    assert [(r["variant"], r["ok"], r["launch_blocking"]) for r in variants] == [("cudnn", True, False)]
    assert finite(variants[0]["ac_off"]["step_s"], variants[0]["ac_on"]["step_s"])
    # two processes (rollout worker, trainer rank) on one device, weights through the object store
    assert "shared: ok" in done.stdout and "weight syncs through the object store" in done.stdout
    ded = json.loads((tmp_path / "dedicated.json").read_text())
    assert ded["tiny"] and ded["errors"] == {} and ded["gpu"] is None
    curve = ded["rollout_batch_curve"]
    assert set(curve) == {"1", "2"} and all(r["mfu"] is None for r in curve.values())  # no peak on CPU
    assert all(finite(r["step_s"], r["per_sample_s"]) and r["per_sample_s"] > 0 for r in curve.values())
    assert curve["2"]["tokens_per_call"] == 2 * curve["1"]["tokens_per_call"]
    comp = ded["compile"]
    assert finite(comp["eager_step_s"], comp["compiled_step_s"], comp["speedup"], comp["compile_s"])
    assert comp["max_abs_diff_latents"] < 1e-4  # the eager backend traces the same ops
    rewards = {(r["reward"], r["images"]) for r in ded["reward"]}
    assert rewards == {("pickscore", 2), ("clipscore", 2)}
    assert all(r["s_per_image"] > 0 and r["params"] > 0 for r in ded["reward"])
    lap = ded["reward_overlap"]
    assert lap["reward"] == "pickscore" and 0.0 <= lap["hidden_share"] <= 1.0 and lap["both_s"] > 0
    fold = json.loads((tmp_path / "fold.json").read_text())
    assert not fold["applies"]  # a dry run never becomes a default
    names = {r["name"]: r for r in fold["defaults"]}
    assert names["model reward s per image"]["measured"] == ded["reward"][0]["s_per_image"]
    assert names["sampling peak efficiency"]["measured"] is None  # no MFU on CPU
    assert names["compiled sampling speed-up"]["measured"] == comp["speedup"]
    assert names["model reward overlap"]["measured"] == lap["hidden_share"]
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert calls["errors"] == {} and len(calls["rows"]) == 3 * 2 * 2 * 2  # families, depths, kinds, batches
    costs = fold["call_costs"]
    assert {(r["family"], r["kind"], r["mode"]) for r in costs["rows"]} == {
        (f, k, "eager") for f in ("sd3", "flux", "wan") for k in ("forward", "train_step")
    }
    assert not costs["applies"] and costs["ray_call_s"] is None  # no Ray in the dry run
    assert all(r["blocks_run_half"] == r["blocks_run"] // 2 for r in costs["rows"])


def test_fold_gpu_check_recovers_the_curve_a_gpu_measured(tmp_path):
    """The fold on GPU-shaped results: MFU points drawn from ``peak n / (n + half)`` give back that peak
    and half; the train step's MFU its implied peak; PickScore's row the reward defaults."""
    sys.path.insert(0, str(BENCH))
    from fold_gpu_check import fold

    from digenrl.planner.efficiency import tokens_factor

    peak, half, tokens = 0.5, 3000.0, 1536
    curve = {
        str(b): {"tokens_per_call": b * tokens, "mfu": peak * tokens_factor(b * tokens, half)}
        for b in (1, 2, 4, 8)
    }
    pick = {
        "reward": "pickscore",
        "backbone": "ViT-H/14",
        "dtype": "bfloat16",
        "params": 986e6,
        "pixels": 512,
    }
    ded = {
        "device": "NVIDIA H200",
        "gpu": "H200",
        "tiny": False,
        "rollout_batch_curve": curve,
        "reward": [pick | {"images": 1, "s_per_image": 0.02}, pick | {"images": 16, "s_per_image": 0.004}],
        "reward_overlap": {"reward": "pickscore", "images": 16, "sample_batch": 4, "hidden_share": 0.25},
        "compile": {"speedup": 1.3, "mode": "default", "backend": "inductor", "batch": 4},
    }
    train_mfu = 0.3 * tokens_factor(4 * tokens, 1024.0)
    rw = {"rollout": {"tokens": tokens, "batch": 4}, "train_ac_off": {"mfu": train_mfu}}
    (tmp_path / "dedicated.json").write_text(json.dumps(ded))
    (tmp_path / "realwidth.json").write_text(json.dumps(rw))
    got = fold(tmp_path)
    m = {r["name"]: r["measured"] for r in got["defaults"]}
    assert got["applies"] and got["errors"] == {}
    assert m["sampling peak efficiency"] == pytest.approx(peak) and m[
        "sampling half tokens"
    ] == pytest.approx(half)
    assert m["training peak efficiency"] == pytest.approx(0.3)
    assert m["model reward s per image"] == 0.004 and m["model reward parameters"] == 986e6
    assert m["model reward overlap"] == 0.25 and m["compiled sampling speed-up"] == 1.3


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine runs the script itself")
def test_gpu_smoke_script_refuses_without_a_gpu(tmp_path):
    """The GPU smoke script parses, and on a machine without a GPU says so and exits non-zero."""
    script = BENCH / "gpu_smoke.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    done = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no GPU visible" in done.stderr


@pytest.mark.slow
def test_ocr_reward(tmp_path):
    pytest.importorskip("rapidocr_onnxruntime", reason="the ocr extra")
    data = run_script("ocr_reward.py", tmp_path, "--sizes", "64", "256", "--repeats", "1")
    assert [r["side"] for r in data["rows"]] == [64, 256]
    assert all(finite(r["text_s"], r["noise_s"]) for r in data["rows"])
    assert [r["text_score"] for r in data["rows"]] == [1.0, 1.0]  # the rendered words read
    assert [r["noise_score"] for r in data["rows"]] == [0.0, 0.0]
    assert data["rss_mib_after"] > data["rss_mib_before"] > 0


@pytest.mark.slow
def test_smallworld_sweep_smoke(tmp_path):
    """ "smallworld_sweep.py": two variants x 3 iterations of the small world, no held-out eval; each run's
    gain is its last third's mean reward minus its first third's, per 1k samples as the script says.
    The second trains on the script's diagnostic ``brightness`` reward: the mean pixel of its samples."""
    bright = "bright:train.lr=3e-4,reward.components.0.name=brightness,reward.components.0.args={}"
    data = run_script(
        "smallworld_sweep.py",
        tmp_path,
        *("--variant", "base:", "--variant", bright),
        *("--iterations", "3", "--seeds", "0", "--eval-seeds", "0"),
    )
    assert [r["name"] for r in data["runs"]] == ["base", "bright"] and "base" not in data
    for r in data["runs"]:
        assert r["iterations"] == 3 and len(r["rewards"]) == 3
        assert r["gain"] == pytest.approx(r["rewards"][-1] - r["rewards"][0])
        assert r["gain_per_1k"] == pytest.approx(r["gain"] / (r["samples"] / 1000))
        assert 0.0 <= r["zero_adv_groups"] <= 1.0 and "held_out" not in r
