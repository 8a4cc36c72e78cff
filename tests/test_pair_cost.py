"""Timestep-pair train batches priced and chosen by the planner (``planner/pair_times.py``): a train
unit's per-forward fixed costs paid once per chunk of pairs instead of once per distinct step and
micro-batch (hand computations on a linear call model), the engine's per-step fallbacks, the memory
of a chunk, and the search choosing ``train.pair_batch`` where it shortens the iteration only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from digenrl.config.run import load_config
from digenrl.placement.plan import Plan, apply_plan
from digenrl.planner.bound import DoesNotFit, setups
from digenrl.planner.call_times import CallTimes, train_unit_time
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import load_cluster
from digenrl.planner.memory import DeviceSetup
from digenrl.planner.pair_times import pair_sizes, pair_unit_time, pieces, uses_pairs
from digenrl.planner.search import candidates, search
from digenrl.planner.workload import Workload
from tests.helpers import run_benchmark_here

ROOT = Path(__file__).resolve().parents[1]
F, C, R, Q = 0.5, 0.01, 0.2, 0.003  # a forward + backward: F + C x rows; a no-grad forward: R + Q x rows


class Linear(CallTimes):
    """A call model whose every forward has a fixed cost (launches, all-gathers) plus a per-row one."""

    def train_step(self, b):
        return F + C * b

    def ref_forward(self, b):
        return R + Q * b


def flux(*sets: str) -> Workload:
    return Workload.from_config(load_config(ROOT / "configs" / "flux1_dev.yaml", list(sets)))


def small(**kw) -> Workload:
    """One unit: 1 group of 6 samples, 3 trained steps, micro-batch 4, no KL."""
    base = dict(group_size=6, trained_steps=3, timestep_mode="fraction", micro_batch=4, kl=False)
    return replace(flux(), optimizer_steps=1, **{**base, **kw})


def test_pairs_pay_the_fixed_cost_once_per_chunk_by_hand():
    w, t = small(), Linear()
    # per step: micro-batches [4, 2] x 3 steps = 6 forwards; 18 rows
    assert train_unit_time(t, w, 1, 0, 1, 4) == pytest.approx(6 * F + 18 * C)
    # pairs of 8 rows: the 18 pairs in chunks [8, 8, 2] = 3 forwards
    assert pair_unit_time(t, w, 1, 0, 1, 4, 8) == pytest.approx(3 * F + 18 * C)
    # TSP rank 1 of 2 trains 1 of the 3 steps: 6 pairs, one chunk (per step: 2 forwards)
    assert pair_unit_time(t, w, 1, 1, 2, 4, 8) == pytest.approx(F + 6 * C)
    # veRL-Omni's old_log_prob pass: a no-grad forward per chunk besides
    assert pair_unit_time(t, w, 1, 0, 1, 4, 8, old_logprob=True) == pytest.approx(
        3 * F + 18 * C + 3 * R + 18 * Q
    )


def test_the_engines_old_logprob_knob_is_what_the_planner_prices():
    """train.old_logprob: recompute (units/train.py: old_logprobs) reaches the workload: the no-grad
    pass per forward, in pairs and per step, by hand as above; the default prices none."""
    assert not flux().old_logprob and flux("train.old_logprob=recompute").old_logprob
    w, t = replace(small(), old_logprob=True), Linear()
    assert pair_unit_time(t, w, 1, 0, 1, 4, 8) == pytest.approx(3 * F + 18 * C + 3 * R + 18 * Q)
    assert train_unit_time(t, w, 1, 0, 1, 4) == pytest.approx(6 * F + 18 * C + 6 * R + 18 * Q)


def test_a_kl_reference_on_the_trainer_runs_per_step_piece_of_each_chunk():
    assert pieces(3, 6, 8) == [6, 2, 4, 4, 2]  # steps of 6 rows cut at 8, 16: five (chunk, step) pieces
    w = small(kl=True, kl_reference="train")
    assert pair_unit_time(Linear(), w, 1, 0, 1, 4, 8) == pytest.approx(3 * F + 18 * C + 5 * R + 18 * Q)


def test_where_the_engine_keeps_per_step_forwards_so_does_the_price():
    w, t = small(), Linear()
    per_step = train_unit_time(t, w, 1, 0, 1, 4)
    assert uses_pairs(w, 8, shard=2)  # a sharded group runs pair batches (its busiest rank's count)...
    kl = small(kl=True, kl_reference="train")  # ...not with a KL reference forward per step
    assert not uses_pairs(kl, 8, shard=2) and uses_pairs(kl, 8, shard=1)
    assert pair_unit_time(t, kl, 1, 0, 1, 4, 8, shard=2) == train_unit_time(t, kl, 1, 0, 1, 4)
    experts = replace(w, shape=replace(w.shape, experts=2))  # Wan2.2: each rank runs both experts a chunk
    assert uses_pairs(experts, 8, shard=2)
    assert pair_unit_time(t, experts, 1, 0, 1, 4, 8, shard=2) == pytest.approx(6 * F + 18 * C)
    nft = replace(w, forward_process=True)  # diffusion_nft-style losses have no pairs
    assert pair_sizes(nft) == (None,) and pair_unit_time(t, nft, 1, 0, 1, 4, 8) == train_unit_time(
        t, nft, 1, 0, 1, 4
    )
    assert pair_unit_time(t, w, 1, 0, 1, 4, None) == per_step


def test_fewer_forwards_save_at_least_their_fixed_costs_on_the_analytic_model():
    """FLUX.1-dev on H800 under FSDP x2: 16 samples x 9 steps at micro-batch 4 are 36 forwards; pairs of
    16 rows are 9. Each forward saved saves its kernels' launches and its all-gathers at least (the
    larger forwards also reach a higher matmul efficiency)."""
    w = flux()
    cost = CostModel(w, load_cluster(ROOT / "configs/clusters/16xH800.yaml"))
    s = DeviceSetup(True, 4, shard=2)
    t = cost.times("H800", s)
    per_step = cost.train_unit("H800", 1, 0, 1, s)
    paired = cost.train_unit("H800", 1, 0, 1, replace(s, pair_batch=16))
    fixed = t.kernels_s("train") + w.passes * 2 * t.fsdp_s  # LoRA: gather forward + backward
    assert w.trained_steps == 9 and fixed > 0
    assert per_step - paired >= (36 - 9) * fixed * (1 - 1e-9)  # (equal where the efficiency is flat)


def test_the_search_takes_pairs_where_they_shorten_the_iteration_only():
    cluster = load_cluster(ROOT / "configs/clusters/16xH800.yaml")

    def best(w: Workload):
        plans = candidates(
            cluster, w.prompts, group_size=w.group_size, disaggregated=False, pairs=pair_sizes(w)
        )
        return search(CostModel(w, cluster), cluster, top=3, plans=plans)

    # random trained steps: a micro-batch's samples split over distinct steps, per-step forwards are small
    res = best(flux("algorithm.timesteps.mode=random", "algorithm.timesteps.fraction=0.5"))
    assert res.ranked[0].plan.pair_batch == 4
    cfg = load_config(ROOT / "configs" / "flux1_dev.yaml")
    assert apply_plan(cfg, res.ranked[0].plan, "cuda").train.pair_batch == 4
    # fraction mode: per-step forwards are whole micro-batches of 4 already; 8 rows need activation
    # checkpointing (slower): no paired plan is proposed
    assert all(r.plan.pair_batch is None for r in best(flux()).ranked)


def test_a_chunk_holds_its_rows_activations():
    w = flux()
    cost = CostModel(w, load_cluster(ROOT / "configs/clusters/16xH800.yaml"))
    pools = tuple(load_cluster(ROOT / "configs/clusters/16xH800.yaml").pools)
    plan = Plan(placement="colocated", pools=pools, unit_groups=2)
    plain = setups(plan, cost)["h800"]
    wide = setups(replace(plan, pair_batch=16), cost)["h800"]
    assert wide.pair_batch == 16 and wide.micro_batch == plain.micro_batch
    assert wide.checkpointing and not plain.checkpointing  # 16 rows' activations need it on an H800
    with pytest.raises(DoesNotFit, match="timestep-pair forwards of 100000 rows"):
        setups(replace(plan, pair_batch=100000), cost)


def test_a_plan_reads_and_writes_train_pair_batch():
    cfg = load_config(ROOT / "configs" / "flux_tiny_disaggregated.yaml", ["train.pair_batch=8"])
    plan = Plan.from_run_config(cfg)
    assert plan.pair_batch == 8 and "pairs8" in plan.knobs()
    assert apply_plan(cfg, replace(plan, pair_batch=None), "cpu").train.pair_batch is None


def test_pair_batches_benchmark(tmp_path):
    """benchmarks/pair_batches.py on 4xH800, random trained steps: both searches, the ratio inside its
    leave-one-out range (the predictions are the benchmark's to report, not judged here)."""
    args = ("--cluster", str(ROOT / "configs/clusters/4xH800.yaml"), "--only", "random")
    (row,) = run_benchmark_here("pair_batches.py", tmp_path, *args)
    lo, hi = row["loo_range"]
    assert row["per_step"]["samples_per_s"] > 0 and lo <= hi
