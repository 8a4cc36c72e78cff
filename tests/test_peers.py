"""The cost model knows batch size; the peers as they run; their calibration on published numbers."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from digenrl.config.run import load_config
from digenrl.placement.devices import DEVICES
from digenrl.planner import peer_verl_omni as verl
from digenrl.planner import peers as peer_models
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import KERNEL_EFFICIENCY, load_cluster
from digenrl.planner.op_counts import forward_ops
from digenrl.planner.params import CostParams
from digenrl.planner.shapes import forward_flops
from digenrl.planner.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
ALL_PEERS = (
    "verl_omni_colocated",
    "verl_omni_batched",
    "verl_omni_async_reward",
    "verl_omni_separate_async",
    "dancegrpo",
    "flow_grpo",
)
CAL_FILE = ROOT / "benchmarks" / "peer_calibration.py"
_spec = importlib.util.spec_from_file_location("peer_calibration", CAL_FILE)
peer_calibration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_calibration)


def _qwen(cluster: str = "4xH800", **params) -> CostModel:
    w = Workload.from_config(load_config(ROOT / "configs" / "qwen_image.yaml"))
    return CostModel(
        w, load_cluster(ROOT / "configs" / "clusters" / f"{cluster}.yaml"), params=CostParams(**params)
    )


def test_a_small_call_costs_more_per_sample_than_a_large_one():
    """Kernel efficiency follows the tokens per call: batch 1 costs more per sample than batch 8, and
    the curve saturates (batch 32 and 64 nearly the same per sample)."""
    t = _qwen().times("H800")
    per = {b: t.rollout_step(b) / b for b in (1, 8, 32, 64)}
    assert per[1] > 1.2 * per[8] > 1.2 * per[32]
    assert per[64] == pytest.approx(per[32], rel=0.05)
    train = {b: t.train_step(b) / b for b in (1, 8)}
    assert train[1] > 1.2 * train[8]


def test_a_rollout_batch_apart_from_the_trainers_micro_batch_changes_the_unit_time():
    """``Workload.rollout_batch`` (engine.rollout_batch N, a later engine item): a rollout-only worker
    sampling at 16 instead of the trainer's micro-batch 1 finishes its unit sooner."""
    cost = _qwen()
    one = replace(cost.workload, micro_batch=1)
    at_one = CostModel(one, cost.cluster).rollout_unit("H800", 2)[0]
    at_16 = CostModel(replace(one, rollout_batch=16), cost.cluster).rollout_unit("H800", 2)[0]
    assert at_16 < 0.9 * at_one


def test_hopper_defaults_are_the_calibrated_pair_and_others_the_generic_one():
    cost = _qwen()
    assert cost.times("H800").efficiency.rollout == KERNEL_EFFICIENCY["H800"][0]
    assert "published peer row" in cost.times("H800").source
    cost = _qwen(mfu_rollout=0.5, mfu_train=0.45)  # configured values win everywhere
    assert cost.times("H800").efficiency.rollout == 0.5


def test_every_peer_is_named_in_the_search_and_cites_its_files():
    from digenrl.planner.search import PEERS, peers

    assert set(PEERS) == set(ALL_PEERS)
    for name in PEERS:
        assert peer_models.SOURCES[name], name
        for what, repo, path in peer_models.SOURCES[name]:
            assert "/" in repo and "." in path and what
    runs = peers(_qwen(), _qwen().cluster)
    assert all(r.fits and r.iteration_s > 0 for r in runs.values()), {n: r.why_not for n, r in runs.items()}


def test_verl_omni_pays_its_structural_costs():
    """Offload, the recompute pass and the server's wake are each paid: switching offload off or the
    judge's cost down shortens the modelled step."""
    qwen = _qwen(model_reward_s=0.2)
    cost = CostModel(replace(qwen.workload, reward_kind="model"), qwen.cluster, params=qwen.params)
    device, n = "H800", 4
    base = verl.verl_omni_phases(cost, device, n)
    quiet = replace(verl.PUBLISHED, param_offload=False, optimizer_offload=False)
    no_offload = verl.verl_omni_phases(cost, device, n, quiet)
    assert sum(no_offload.values()) < sum(base.values())
    assert base["old_log_prob"] > 0 and base["update_weights"] >= verl.PUBLISHED.push_latency_s
    assert base["reward"] == pytest.approx(0.2 * cost.workload.samples / n)


def test_dancegrpo_all_gathers_fp32_parameters_every_forward():
    """DanceGRPO samples at batch 1 through FULL_SHARD with fp32 parameters: across two nodes its
    sampling costs more than the same forwards unsharded."""
    w = Workload.from_config(load_config(ROOT / "configs" / "recipes" / "dancegrpo_flux_hpsv2.yaml"))
    cluster = load_cluster(ROOT / "configs" / "clusters" / "16xH800.yaml")
    cost = CostModel(w, cluster)
    run = peer_models.dancegrpo(cost, cluster)
    per = w.samples / 16
    compute_only = per * w.steps * cost.times("H800").rollout_step(1)
    assert run.phases["sampling (batch 1)"] > 1.5 * compute_only


def test_plan_peers_prints_digenrl_beside_each_peer(monkeypatch, capsys):
    from helpers import cli as cli_main

    args = ["plan", "-c", str(ROOT / "configs" / "qwen_image.yaml"), "--cluster"]
    args += [str(ROOT / "configs" / "clusters" / "4xH800.yaml"), "--peers", "--json", "--top", "1"]
    code, out, err = cli_main(monkeypatch, capsys, *args)
    assert code in (0, None), err
    report = json.loads(out)
    peers = report["peers"]["peers"]
    assert set(peers) == set(ALL_PEERS)
    for row in peers.values():
        assert row["digenrl_speedup"] > 0 and row["sources"]
    assert report["peers"]["efficiency"]["H800"]["sampling"] == KERNEL_EFFICIENCY["H800"][0]
    assert report["baselines"]["colocated"] is not None  # our engine's strong baselines stay


def _verl_setup():
    from digenrl.planner.published import CALIBRATION

    w, cluster = CALIBRATION.workload(), CALIBRATION.load_cluster()
    return CostModel(w, cluster, params=CostParams(model_reward_s=0.2)), cluster


def test_verl_omni_batching_and_bypass_as_its_code_runs_them():
    """A request is one image and true CFG two calls of the same requests (vllm_omni_rollout_adapter
    :443 / :456): at max_num_seqs b the server makes ceil(128 / b) x steps x 2 calls of b images per GPU;
    bypass mode drops the recompute pass and nothing else."""
    cost, _ = _verl_setup()
    w = cost.workload
    serial = verl.verl_omni_phases(cost, "H800", 4, verl.PUBLISHED)
    batched = verl.verl_omni_phases(cost, "H800", 4, verl.BATCHED)
    per = w.samples / 4

    ops, elems = forward_ops(w.shape, fused=True)  # vLLM-Omni's transformer (op_counts.SERVED_FUSED)
    assert ops < forward_ops(w.shape)[0]
    bw = DEVICES["H800"].mem_bw * cost.params.mem_bw_efficiency

    def call(b):  # by hand: b images' FLOPs at the matmul efficiency, the kernels, the memory-bound bytes
        compute = b * forward_flops(w.shape) / (DEVICES["H800"].bf16_flops * KERNEL_EFFICIENCY["H800"][0])
        return compute + ops * cost.params.op_launch_s + b * elems * w.dtype_bytes / bw

    fixed = serial["generation"] - w.steps * per * 2 * call(1)  # encode, decode, wake: the same in both
    assert fixed > 0 and batched["generation"] == pytest.approx(fixed + w.steps * (per / 32) * 2 * call(32))
    assert batched["generation"] < 0.6 * serial["generation"]  # the measured -52% is a batching effect
    assert batched["old_log_prob"] == 0.0 and serial["old_log_prob"] > 0
    assert batched["update_actor"] == pytest.approx(serial["update_actor"])
    assert verl.today(w).server_batch == 8 and verl.today(replace(w, lora=False)).server_batch == 32


def test_async_reward_scores_on_its_own_gpu_behind_generation():
    """One GPU of five judges (run_qwen_image_ocr_lora_async_reward.sh): the actor's phases run on four,
    and the judge adds only what it needs beyond generation (hand-computed from the same phases)."""
    cost, _ = _verl_setup()
    five = load_cluster(ROOT / "configs" / "clusters" / "5xH800.yaml")
    cost5 = CostModel(cost.workload, five, params=cost.params)
    run = verl.verl_omni_async_reward(cost5, five, verl.PUBLISHED)
    on_four = verl.verl_omni_phases(cost5, "H800", 4, verl.PUBLISHED)
    beyond = max(0.0, on_four["reward"] * 4 - on_four["generation"])
    assert run.devices == 5 and run.phases["reward (beyond generation)"] == pytest.approx(beyond)
    expected = sum(v for k, v in on_four.items() if k != "reward") + beyond
    assert run.iteration_s == pytest.approx(expected)


def test_the_shipped_defaults_are_the_fit_of_every_row():
    """CostParams' and gpus.py's fitted defaults are planner/cost_fit.json's fit of all rows (written by
    benchmarks/peer_calibration.py --write-fits), with fewer parameters than rows."""
    from digenrl.planner.uncertainty import fits

    f = fits()
    p = CostParams()
    assert KERNEL_EFFICIENCY["H800"] == pytest.approx(
        (f["all"]["mfu_rollout"], f["all"]["mfu_train"]), rel=0.01
    )
    assert p.op_launch_s == pytest.approx(f["all"]["op_launch_s"], rel=0.01)
    assert p.dispatch_s_per_worker == pytest.approx(f["all"]["dispatch_s_per_worker"], rel=0.01)
    assert p.serve_seq_step_s == pytest.approx(f["all"]["serve_seq_step_s"], rel=0.01)
    assert len(f["all"]) < len(f["rows"]) and set(f["leave_one_out"]) == {r["group"] for r in f["rows"]}


@pytest.mark.slow  # seconds of planner search or model timing: the full suite runs it
def test_peer_calibration_benchmark_writes_every_row_with_its_errors(tmp_path):
    """The benchmark's JSON (--quick: the fit of all rows only): the parameters, every row with its
    published figure and both errors, the phases of veRL-Omni's step, DigenRL's ratio to each peer."""
    out = tmp_path / "cal.json"
    assert peer_calibration.main(["--json", str(out), "--quick"]) == 0
    r = json.loads(out.read_text())
    assert len(r["params"]) < len(r["rows"]) and r["peers"]["rows"] >= 12 and r["own"]["rows"] >= 5
    for row in r["rows"]:
        assert row["published"] > 0 and math.isfinite(row["error"]) and row["source"]
        assert row["loo_error"] == pytest.approx(row["error"])  # --quick: one fit
    names = [p["name"] for p in r["calibration"]["phases"]]
    assert names[:5] == ["generation", "update_actor", "old_log_prob", "reward", "update_weights"]
    assert sum(row["name"].startswith("MM-GRPO SD3.5-M") for row in r["rows"]) == 3
    assert {"verl_omni_batched", "verl_omni_colocated"} <= set(r["ratios"])
    for v in r["ratios"].values():
        assert v["min"] == pytest.approx(v["all"]) == pytest.approx(v["max"])  # one fit: no range
    # the fields tests/test_benchmarks.py's smoke test of this script read (it runs here, in-process)
    assert all(0 < p["value"] for p in r["params"]) and r["read_off"]["judge_s_per_image"] > 0


def test_plan_peers_on_verl_omnis_own_run_puts_digenrl_at_or_above_it(monkeypatch, capsys):
    """The recipe of veRL-Omni's published run (its judge served on the same 4 GPUs: ``server:
    cluster``), planned with --peers on 4xH800: the workload is the calibration's, and DigenRL's best
    plan is at least as fast as every veRL-Omni variant as its examples run today."""
    from helpers import cli as cli_main

    from digenrl.planner.published import CALIBRATION, VERL_OMNI_PHASES

    recipe = ROOT / "configs" / "recipes" / "verl_omni_qwen_image_ocr_lora.yaml"
    w, cal = Workload.from_config(load_config(recipe)), CALIBRATION.workload()
    same = ("steps", "trained_steps", "group_size", "prompts", "passes", "kl", "lora", "micro_batch")
    assert [getattr(w, f) for f in same] == [getattr(cal, f) for f in same]
    assert (w.params, w.optimizer_steps) == (cal.params, cal.optimizer_steps)
    # the shape but the text: DigenRL pads every prompt to max_text_len, veRL-Omni's run strips the
    # padding (52 prompt tokens, 6 for the negative prompt: the calibration's mean per pass)
    assert replace(w.shape, tokens=replace(w.shape.tokens, text=29)) == cal.shape
    assert w.shape.tokens.text == 256
    judge_s = VERL_OMNI_PHASES["reward"] / (w.samples / 4)  # the published reward phase, per GPU's images
    assert w.reward_terms == (("model", pytest.approx(judge_s, rel=0.01)),)
    args = ["plan", "-c", str(recipe), "--cluster", str(ROOT / "configs" / "clusters" / "4xH800.yaml")]
    code, out, err = cli_main(monkeypatch, capsys, *args, "--peers", "--json", "--top", "1")
    assert code in (0, None), err
    peers = json.loads(out)["peers"]["peers"]
    verl_rows = {k: v for k, v in peers.items() if k.startswith("verl_omni")}
    assert set(verl_rows) == {k for k in ALL_PEERS if k.startswith("verl_omni")}
    assert peers["verl_omni_batched"]["phases_s"]["old_log_prob"] == 0.0  # bypass mode, as its example
    assert all(r["fits"] and r["digenrl_speedup"] >= 1.0 for r in verl_rows.values())
