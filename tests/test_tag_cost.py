"""TAG's cost on a trainer rank (the authors' RFC, verl-project/verl-omni#321: the helper runs only at a
safe boundary, never inside an active update, and leaves accumulated gradients intact; "both
Actor -> helper -> Actor switches ... are included in scheduling cost"): the simulator charges a
TAG rank's phase switch both ways, the memory model refuses TAG where a rollout unit does not fit
beside the trainer state, the trajectory it holds is what the sampler allocates, and a rollout
between two train units changes neither the accumulated gradients nor the optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.placement.plan import Plan
from digenrl.planner.bound import DoesNotFit, setups
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import cluster_from_dict
from digenrl.planner.memory import MemoryModel
from digenrl.planner.params import CostParams
from digenrl.planner.search import search
from digenrl.planner.sim_bts import priors
from digenrl.planner.simulator import Simulator
from digenrl.planner.workload import Workload
from digenrl.units.train import train_unit
from digenrl.units.types import RolloutUnit, TrainUnit
from tests.test_pair_batches import unit_and_policy
from tests.test_planner import ConstantCost

ROOT = Path(__file__).resolve().parents[1]
SWITCH = 0.7


class SwitchCost(ConstantCost):
    """Fixed unit times, and a phase switch of ``SWITCH`` seconds."""

    def switch(self, device, setup):
        return SWITCH


def tag_plan(tag=True) -> Plan:
    cfg = load_config(ROOT / "configs" / "flux_tiny_disaggregated.yaml", [f"engine.tag={str(tag).lower()}"])
    return Plan.from_run_config(cfg).typed()


def test_a_tag_rank_pays_the_phase_switch_both_ways(tiny_cfg):
    cost = SwitchCost(tiny_cfg())
    sim = Simulator(tag_plan(), cost, iterations=2)
    trainer = next(w for w in sim.order if sim.role[w] == "trainer")
    roller = next(w for w in sim.order if sim.role[w] == "rollout")
    rollout, train = RolloutUnit("r", 0, 0, (0,), 0), TrainUnit("t", 0, "r", (0,), 0, 0, 1, 0)

    def switches(worker, unit):
        return [s.amount for s in sim._segments(worker, unit, 0.0) if s.kind == "switch"]

    assert switches(trainer, train) == []  # a trainer rank starts set up for training
    assert switches(trainer, rollout) == [SWITCH]  # Actor -> helper
    assert switches(trainer, rollout) == []  # a second TAG unit in a row: still sampling
    assert switches(trainer, train) == [SWITCH]  # helper -> Actor
    assert switches(roller, rollout) == []  # a rollout worker never switches
    # BTS's priors for a TAG unit include the switch to sampling (the one back: the next unit's)
    prior = priors(sim, sim.sched.cfg)
    assert prior[("rollout", trainer)] == pytest.approx(prior[("rollout", roller)] + SWITCH)


def two_pools(trainer: str):
    return cluster_from_dict(
        {
            "name": "x",
            "pools": [
                {"name": "rollout", "device": "H200", "count": 2},
                {"name": "trainer", "device": trainer, "count": 2},
            ],
        }
    )


def test_the_plan_refuses_tag_where_a_rollout_does_not_fit_beside_the_trainer_state():
    """FLUX.1-dev LoRA, units of 8 groups, trainers on 2 x A100-40GB: the training state fits (FSDP x2)
    but not with a rollout unit's models and activations beside it; TAG on and auto are refused."""
    cluster = two_pools("A100-40GB")
    cost = CostModel(Workload.from_config(load_config(ROOT / "configs" / "flux1_dev.yaml")), cluster)

    def plan(tag):
        return Plan(placement="disaggregated", pools=tuple(cluster.pools), unit_groups=8, tag=tag)

    plain = setups(plan(False), cost)["trainer"]
    held = set(plain.parts)
    assert {"frozen base", "fp32 masters", "fp32 grads", "AdamW state", "compute copy"} <= held
    for tag in (True, "auto"):
        with pytest.raises(DoesNotFit, match="a TAG trainer rank on A100-40GB needs .*rollout models") as e:
            setups(plan(tag), cost)
        assert e.value.args[1] > 1  # need / have
    # the encoders and VAE a TAG rank adds, by hand: T5-XXL 4.762 B + CLIP-L 0.123 B + VAE 0.084 B, bf16
    parts = MemoryModel(cost.workload, cost.params).trainer_need(2, plain.micro_batch, False, True, 8)
    assert parts["rollout models"] == pytest.approx(2 * (4.762e9 + 0.123e9 + 0.084e9), rel=0.01)
    res = search(cost, cluster, top=3, iterations=2, plans=[plan(False), plan(True), plan("auto")])
    assert [r.plan.tag for r in res.ranked] == [False] and len(res.rejected) == 2


def test_the_trajectory_a_rank_holds_is_what_the_sampler_allocates():
    policy, unit = unit_and_policy("flux_tiny.yaml", [])
    w = Workload.from_config(policy.cfg)
    buffers = unit.latents.nbytes + unit.log_probs.nbytes + unit.step_noise.nbytes
    assert buffers == MemoryModel(w, CostParams()).trajectory_bytes(len(unit))


def test_a_rollout_between_train_units_leaves_the_update_intact():
    """The engine hands a trainer rank a rollout unit only between units (``Scheduler._pick``: no
    train unit ready, no step unfinished, mini-batch 0); the rollout must not touch the gradients the
    rank accumulated, its weights or its optimizer: train A, roll out, train B == train A, train B."""
    from digenrl.data.prompts import PromptSampler, load_prompts
    from digenrl.rewards import build_reward
    from digenrl.units.rollout import rollout_unit, scored

    policy, unit = unit_and_policy("flux_tiny.yaml", [])
    terms = 2 * len(unit) * unit.train_idx.shape[1]

    def grads():
        return {n: p.grad.clone() for n, p in policy.named_params.items()}

    for p in policy.params:
        p.grad = None
    train_unit(policy, unit, terms)
    train_unit(policy, unit, terms)
    want = grads()
    for p in policy.params:
        p.grad = None
    train_unit(policy, unit, terms)
    after_a = grads()
    weights = {n: p.detach().clone() for n, p in policy.named_params.items()}
    cfg = policy.cfg
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(1, 1)
    tag_samples = scored(rollout_unit(policy, prompts, [0], 1, cfg.train.seed), build_reward(cfg.reward))
    assert len(tag_samples) == policy.cfg.algorithm.group_size
    for n, p in policy.named_params.items():  # the helper left the accumulated gradient and weights
        assert torch.equal(p.grad, after_a[n]) and torch.equal(p.detach(), weights[n]), n
    assert not policy.optimizer.state  # and committed no optimizer step
    train_unit(policy, unit, terms)
    for n, g in grads().items():
        assert torch.equal(g, want[n]), n


def _sharded_tag(rank, world, out):
    """Both ranks of an FSDP2 group: train a share, (TAG) roll out a unit through the sharded module
    together, train again; the same with no rollout between. Each rank's gradient shards saved."""
    from digenrl.data.prompts import PromptSampler, load_prompts
    from digenrl.distributed import fsdp
    from digenrl.engine.fsdp_group import train_share
    from digenrl.units.rollout import rollout_unit

    policy, unit = unit_and_policy("flux_tiny.yaml", [])
    fsdp.shard_policy(policy, fsdp.trainer_mesh())
    share, terms = TrainUnit("train-0-0-0", 0, "rollout-0-0", (0,), 0, 0, 1, 0), 2 * len(unit) * 4
    cfg = policy.cfg
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(1, 1)
    result = {}
    for tag in (False, True):
        for p in policy.params:
            p.grad = None
        train_share(policy, unit, share, rank, world, terms)
        if tag:
            before = {n: p.grad.to_local().clone() for n, p in policy.named_params.items()}
            rollout_unit(policy, prompts, [0], 1, cfg.train.seed)
            result["intact"] = all(
                torch.equal(p.grad.to_local(), before[n]) for n, p in policy.named_params.items()
            )
        train_share(policy, unit, share, rank, world, terms)
        result[tag] = {n: p.grad.to_local().clone() for n, p in policy.named_params.items()}
    result["optimizer"] = len(policy.optimizer.state)
    torch.save(result, out / f"rank{rank}.pt")


@pytest.mark.slow
def test_a_sharded_ranks_rollout_leaves_its_gradient_shards_intact(tmp_path):
    from tests.dist_spawn import spawn

    spawn(_sharded_tag, 2, tmp_path)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["intact"] and r["optimizer"] == 0
        assert r[True].keys() == r[False].keys() and all(
            torch.equal(r[True][n], r[False][n]) for n in r[False]
        )
