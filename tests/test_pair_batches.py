"""Timestep-pair train batches (``train.pair_batch``, TSP as (sample, step) pairs in the authors' RFC,
verl-omni#321): a train unit's (sample, trained step) pairs run in forwards of ``pair_batch`` rows,
each row at its own timestep. Per family, the gradient equals the per-step loop's (to fp32
rounding), the forwards drop to ceil(pairs / pair_batch), and the on-policy log-prob is recomputed
to rounding (``logprob_mismatch`` small, no longer 0)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.policy.model import Policy
from digenrl.rewards import build_reward
from digenrl.units import train as units_train
from digenrl.units.advantages import assign_advantages
from digenrl.units.rollout import rollout_unit, scored
from digenrl.units.train import merge_stats, pair_chunks, train_unit

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.prompts_per_iteration=1", "algorithm.group_size=3", "train.micro_batch=2", "sampling.steps=4"]
HALF = ["algorithm.timesteps.fraction=0.5"]
#: every family of digenrl/adapters (each transformer takes a timestep per row: diffusers' transformers
#: embed a (batch,) timestep; Wan2.2 TI2V one per token); Wan2.2 A14B runs each expert on its rows of a
#: mixed batch, high-noise first. None excluded; the forward-process losses (diffusion_nft, AWM, online
#: DPO) have no (sample, step) pairs
FAMILIES = {
    "flux": ("flux_tiny.yaml", []),
    "sd3": ("sd3_tiny.yaml", []),
    "wan": ("wan_tiny.yaml", []),
    # random trained steps: the pairs of one forward run on both experts (steps 0 high, 1-2 low noise)
    "wan2.2_experts": ("wan2.2_tiny.yaml", ["algorithm.timesteps.mode=random", *HALF]),
    "hunyuan_video": ("hunyuan_tiny.yaml", []),
    "qwen_image": ("qwen_tiny.yaml", []),
    "flux2": ("flux2_tiny.yaml", []),
    "flux_kontext": ("flux_kontext_tiny.yaml", []),
    "hunyuan_video15": ("hunyuan_video15_tiny.yaml", []),
    "qwen_image_edit": ("qwen_image_edit_tiny.yaml", []),
    "wan2.2_ti2v": ("wan2.2_ti2v_tiny.yaml", []),
    "z_image": ("z_image_tiny.yaml", []),
}


def unit_and_policy(config: str, sets: list[str]):
    cfg = load_config(ROOT / "configs" / config, [*SMALL, *sets, "train.device=cpu"])
    torch.manual_seed(cfg.train.seed)
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(0, 1)
    policy = Policy(cfg)
    with torch.no_grad():  # LoRA's B starts at zero: move it, so that every LoRA weight gets a gradient
        for p in policy.params:
            p.add_(0.01 * torch.randn_like(p))
    unit = scored(rollout_unit(policy, prompts, [0], 0, cfg.train.seed), build_reward(cfg.reward))
    assign_advantages([unit], cfg)
    unit.advantages = torch.linspace(-1.0, 1.0, len(unit))  # tiny rewards can tie: advantages that differ
    return policy, unit


def gradient(policy, unit, pair_batch: int | None, monkeypatch) -> tuple[dict, int, dict]:
    """(parameter gradients, forwards (each the guided velocity of one batch, with its backward), stats)
    of one train unit."""
    policy.cfg.train.pair_batch = pair_batch
    for p in policy.params:
        p.grad = None
    forwards = []
    run = units_train.backward_through_velocity
    monkeypatch.setattr(units_train, "backward_through_velocity", lambda *a: forwards.append(1) or run(*a))
    stats = merge_stats([train_unit(policy, unit, len(unit) * unit.train_idx.shape[1])])
    monkeypatch.undo()
    return {n: p.grad.clone() for n, p in policy.named_params.items()}, len(forwards), stats


@pytest.mark.parametrize("family", FAMILIES)
def test_pair_batches_give_the_per_step_gradient_in_fewer_forwards(family, monkeypatch):
    policy, unit = unit_and_policy(*FAMILIES[family])
    steps, got_steps, st_steps = gradient(policy, unit, None, monkeypatch)
    pairs, got_pairs, st_pairs = gradient(policy, unit, 5, monkeypatch)
    for name, g in steps.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(pairs[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()))
    n_pairs = int(unit.train_idx.numel())  # every sample's trained steps (each trains a step once)
    per_step = sum(len(unit.train_idx[mb].unique()) for mb in torch.arange(len(unit)).split(2))
    assert (got_steps, got_pairs) == (per_step, math.ceil(n_pairs / 5))
    assert st_pairs["loss"] == pytest.approx(st_steps["loss"], rel=1e-4, abs=1e-6)
    # the rollout forwarded in the per-step batches: recomputed in pairs, its log-prob to rounding only
    assert st_steps["logprob_mismatch"] == 0.0 and st_pairs["logprob_mismatch"] < 1e-4


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_recomputing_the_old_logprob_in_the_pair_batches_makes_the_first_ratio_one(family, monkeypatch):
    """train.old_logprob: recompute (veRL-Omni's old_log_prob pass, in each pair forward's own rows):
    the on-policy ratio is 1 (the pass and the train forward: the same rows, the same kernels), where the
    rollout's log-prob leaves it off by the batches' rounding (~1e-7 here); logprob_mismatch is logged
    either way; the gradient is the same to rounding."""
    policy, unit = unit_and_policy(*FAMILIES[family])
    kept, _, st_kept = gradient(policy, unit, 5, monkeypatch)
    policy.cfg.train.old_logprob = "recompute"
    again, forwards, st_again = gradient(policy, unit, 5, monkeypatch)
    assert st_kept["logprob_mismatch"] > 0 and (st_kept["ratio_min"], st_kept["ratio_max"]) != (1.0, 1.0)
    assert st_again["ratio_min"] == st_again["ratio_max"] == 1.0
    assert st_again["logprob_mismatch"] == pytest.approx(st_kept["logprob_mismatch"], rel=1e-3)
    assert forwards == math.ceil(int(unit.train_idx.numel()) / 5)  # backward passes: as many as before
    for name, g in kept.items():
        torch.testing.assert_close(again[name], g, rtol=1e-3, atol=1e-4 * float(g.abs().max()))


def test_recompute_needs_one_optimizer_step():
    from digenrl.errors import UserError

    with pytest.raises(UserError, match="train.old_logprob: recompute needs train.optimizer_steps 1"):
        load_config(None, ["train.old_logprob=recompute", "train.optimizer_steps=2"])


def test_pairs_are_cut_in_step_order_and_a_step_may_span_two_forwards():
    rows = [[0, 1, 2], [0, 2], [1]]
    groups = [(i, torch.tensor(r), False) for i, r in zip((0, 2, 3), rows)]
    chunks = pair_chunks(groups, 2)
    assert [[(i, sel.tolist()) for i, sel, _ in c] for c in chunks] == [
        [(0, [0, 1])],
        [(0, [2]), (2, [0])],
        [(2, [2]), (3, [1])],
    ]


def test_a_bad_pair_batch_names_the_field():
    from digenrl.errors import UserError

    with pytest.raises(UserError, match="train.pair_batch"):
        load_config(None, ["train.pair_batch=0"])


# -- a sharded group: the same gradient, fewer forwards, fewer all-gathers --------------------------


def _sharded(rank, world, out):
    """Both ranks of an FSDP2 group train one unit's shares (3 samples: 2 + 1, DanceGRPO's random
    steps: the ranks train different steps) per step and in pairs; all-gathers counted."""
    import torch.distributed as dist

    from digenrl.distributed import fsdp
    from digenrl.engine.fsdp_group import train_share
    from digenrl.units.types import TrainUnit

    policy, unit = unit_and_policy("flux_tiny.yaml", ["algorithm.timesteps.mode=random", *HALF])
    mesh = fsdp.trainer_mesh()
    fsdp.shard_policy(policy, mesh)
    gathers, gather = [], dist.all_gather_single
    dist.all_gather_single = lambda *a, **k: gathers.append(1) or gather(*a, **k)
    share = TrainUnit("train-0-0-0", 0, "rollout-0-0", (0,), 0, 0, 1, 0)
    result = {}
    for pair_batch in (None, 4):
        policy.cfg.train.pair_batch = pair_batch
        for p in policy.params:
            p.grad = None
        gathers.clear()
        train_share(policy, unit, share, rank, world, len(unit) * unit.train_idx.shape[1])
        fsdp.all_reduce_replicas(policy.params, mesh)
        from tests.test_fsdp import _grads

        result[pair_batch] = (_grads(policy.adapter.transformer), len(gathers))
    result["pairs"] = int(unit.train_idx.numel())
    result["steps"] = [sorted(set(unit.train_idx[rows].flatten().tolist())) for rows in ([0, 1], [2])]
    torch.save(result, out / f"rank{rank}.pt")


@pytest.mark.slow
def test_a_sharded_group_trains_pairs_with_the_same_gradient_and_fewer_all_gathers(tmp_path):
    from tests.dist_spawn import spawn

    spawn(_sharded, 2, tmp_path)
    r = torch.load(tmp_path / "rank0.pt")
    (steps, per_step), (pairs, in_pairs) = r[None], r[4]
    for name, g in steps.items():
        torch.testing.assert_close(pairs[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()))
    # per step: one pass per step either rank trains (the group's lockstep); in pairs: the busiest
    # rank's ceil(pairs / 4) -- each pass the same gathers (the forward's and the backward's)
    passes_steps = len(set(r["steps"][0]) | set(r["steps"][1]))
    passes_pairs = -(-r["pairs"] * 2 // 3 // 4)  # rank 0 holds 2 of the 3 samples
    assert per_step % passes_steps == 0 and in_pairs * passes_steps == per_step * passes_pairs
    assert in_pairs < per_step
    assert torch.load(tmp_path / "rank1.pt")[4][1] == in_pairs  # the ranks ran the same collectives


def _sharded_experts(rank, world, out):
    """Wan2.2's two experts on a 2-rank FSDP2 group, random steps (a rank's rows of a chunk may need
    either expert): per step, in pairs, and in pairs with the old-log-prob pass."""
    import torch.distributed as dist

    from digenrl.distributed import fsdp
    from digenrl.engine.fsdp_group import train_share
    from digenrl.units.types import TrainUnit
    from tests.test_fsdp import _grads

    forwards, run = [], units_train.backward_through_velocity
    units_train.backward_through_velocity = lambda *a: forwards.append(1) or run(*a)
    policy, unit = unit_and_policy(*FAMILIES["wan2.2_experts"])
    mesh = fsdp.trainer_mesh()
    fsdp.shard_policy(policy, mesh)
    gathers, gather = [], dist.all_gather_single
    dist.all_gather_single = lambda *a, **k: gathers.append(1) or gather(*a, **k)
    share = TrainUnit("train-0-0-0", 0, "rollout-0-0", (0,), 0, 0, 1, 0)
    result = {}
    for key, pair_batch, old in (
        ("steps", None, "rollout"),
        ("pairs", 4, "rollout"),
        ("recompute", 4, "recompute"),
    ):
        policy.cfg.train.pair_batch, policy.cfg.train.old_logprob = pair_batch, old
        for p in policy.params:
            p.grad = None
        gathers.clear(), forwards.clear()
        stats = train_share(policy, unit, share, rank, world, len(unit) * unit.train_idx.shape[1])
        fsdp.all_reduce_replicas(policy.params, mesh)
        result[key] = (_grads(policy.adapter.transformer), len(gathers), stats, len(forwards))
    result["pairs_n"] = int(unit.train_idx.numel())
    torch.save(result, out / f"rank{rank}.pt")


@pytest.mark.slow
def test_a_sharded_group_trains_two_experts_in_pairs_in_lockstep(tmp_path):
    """Every rank runs each pair forward on both experts, high-noise first (a dummy row where its rows
    need only one): the ranks run the same collectives, the gradient is the per-step loop's, and the
    old-log-prob pass (no grad, the same forwards) adds no collective mismatch."""
    from tests.dist_spawn import spawn

    spawn(_sharded_experts, 2, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{k}.pt") for k in (0, 1))
    steps = r0["steps"][0]
    for key in ("pairs", "recompute"):
        for name, g in steps.items():
            torch.testing.assert_close(r0[key][0][name], g, rtol=1e-3, atol=1e-4 * float(g.abs().max()))
        assert r0[key][1] == r1[key][1]  # the same all-gathers on both ranks
    assert r0["recompute"][2]["ratio_max"] == r0["recompute"][2]["ratio_min"] == 1.0
    # rank 0 holds 2 of the 3 samples: ceil(its pairs / 4) forwards in pairs, fewer than per step
    assert r0["pairs"][3] == -(-r0["pairs_n"] * 2 // 3 // 4) < r0["steps"][3]
    assert r0["pairs"][1] < r0["steps"][1]  # fewer all-gathers, both experts gathered per forward
