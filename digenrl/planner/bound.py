"""What a plan costs without simulating it: each pool's device setup (memory decisions) and the
throughput bound on the iteration time (docs/architecture.md). The simulator starts from the same
setups and unit times; its result is judged against the bound (``SimResult.efficiency``)."""

from __future__ import annotations

from dataclasses import replace

from digenrl.config.engine import PoolConfig
from digenrl.placement.plan import Plan
from digenrl.planner.costmodel import CostModel
from digenrl.planner.memory import DeviceSetup


def unit_train_time(
    cost: CostModel,
    device: str,
    groups: int,
    parts: int,
    tsp_rank: int,
    tsp_degree: int,
    setup: DeviceSetup | None,
) -> float:
    """A train unit (one mini-batch's share) of ``groups`` whole groups, or (``parts`` > 1) of 1/parts
    of one group: the group's time shared out by samples (the micro-batches of a part are its share
    of the group's)."""
    return cost.train_unit(device, groups, tsp_rank, tsp_degree, setup) / parts


class DoesNotFit(Exception):
    """The plan's memory does not fit on some device: ``args`` = (why, need / have)."""


def setups(plan: Plan, cost: CostModel) -> dict[str, DeviceSetup]:
    """Per pool: how its devices run (memory decisions), or DoesNotFit."""
    out = {}
    for p in plan.pools:
        role = plan.role(p)
        if role == "rollout":
            s = cost.rollout_memory(p.device, plan.unit_size, plan.rollout_sp)
        elif role == "trainer":
            s = cost.trainer_setup(
                p.device, plan.ranks, plan.tag, plan.unit_size, plan.micro_batch, plan.trainer_sp
            )
        else:
            s = cost.colocated_setup(p.device, plan.ranks, plan.unit_size, plan.micro_batch, plan.trainer_sp)
        if not s.fits:
            raise DoesNotFit(s.why, s.need_bytes / max(s.have_bytes, 1.0))
        if plan.pair_batch and role != "rollout":
            s = with_pairs(s, plan, p.device, cost, role == "both" or bool(plan.tag))
        out[p.name] = s
    return out


def pairs_shorten(plan: Plan, cost: CostModel, paired: dict, plain: dict) -> bool:
    """Do the plan's pair batches (setups ``paired``) shorten its train units on some trainer pool
    against its per-step twin (setups ``plain``)? If not, the twin, whose ratio is exactly 1, is as
    fast, and the search drops the paired plan."""
    m, parts, D = plan.unit_groups, plan.group_parts, plan.tsp_degree
    for pool in plan.trainer_pools:
        with_ = unit_train_time(cost, pool.device, m, parts, 0, D, paired[pool.name])
        if with_ < unit_train_time(cost, pool.device, m, parts, 0, D, plain[pool.name]) * (1 - 1e-9):
            return True
    return False


def with_pairs(s: DeviceSetup, plan: Plan, device: str, cost: CostModel, samples: bool) -> DeviceSetup:
    """``s`` training in timestep-pair forwards of ``plan.pair_batch`` rows (``samples``: the rank also
    rolls out): a forward holds that many samples' activations, so the cheapest way a rank holds a
    forward of that many rows (its FSDP degree, checkpointing, CFG mode) -- the rollout's batches stay
    ``s``'s -- or DoesNotFit."""
    n = plan.pair_batch
    fits, miss = cost.memory.setups(
        device, plan.ranks, samples, plan.unit_size, s.sp, micro_batch=max(n, s.micro_batch)
    )
    if not fits:
        raise DoesNotFit(f"timestep-pair forwards of {n} rows: {miss.why}", miss.need_bytes / miss.have_bytes)
    best = cost._best(fits, device, plan.ranks, plan.placement == "colocated")
    return replace(best, micro_batch=s.micro_batch, pair_batch=n, rollout_batch=s.rollout_batch)


def bound(plan: Plan, cost: CostModel, setup: dict[str, DeviceSetup] | None = None) -> float:
    """The throughput bound on the iteration time (docs/architecture.md), generalised to device
    types of different speeds by a fluid split of the work: colocated ``(R+T)/(r+t)``,
    disaggregated ``max(R/r, T/t)``, with TAG ``max(T/t, (R+T)/(r+t))`` (R, T: rollout / train
    device-seconds; T includes every rank's ``train.optimizer_steps`` steps and, colocated, the
    phase switches). Engine overheads (calls, transfers, weight sync) are left out; so is that a
    TAG rank rolls out only before an iteration's first step (that only lengthens an iteration)."""
    setup = setup if setup is not None else setups(plan, cost)
    m, parts, D, ranks, S = (
        plan.unit_groups,
        plan.group_parts,
        plan.tsp_degree,
        plan.ranks,
        cost.workload.optimizer_steps,
    )
    units = cost.workload.prompts // m * parts

    def work(pool: PoolConfig) -> tuple[float, float, float]:
        s = setup[pool.name]
        R = units * cost.rollout_unit(pool.device, plan.unit_size, s)[0]
        if plan.role(pool) == "rollout":  # (its units' reward partly beside the next unit)
            return R - units * cost.reward_hidden(pool.device, plan.unit_size, s), 0.0, 0.0
        T = units * S * sum(unit_train_time(cost, pool.device, m, parts, r, D, s) for r in range(D))
        own = S * cost.step(pool.device, ranks, False, s)[0]
        if plan.role(pool) == "both":
            own += 2 * cost.switch(pool.device, s)
        return R, T, own

    if plan.placement == "colocated":
        inv, off = 0.0, 0.0
        for p in plan.pools:
            R, T, own = work(p)
            inv += plan.worker_count(p) / (R + T)
            off += plan.worker_count(p) * own / (R + T)
        return (1 + off) / inv
    r_pool, t_pool = plan.rollout_pool, plan.trainer_pools[0]
    Rr, _, _ = work(r_pool)
    Rt, Tt, own = work(t_pool)
    r, t = plan.worker_count(r_pool), plan.worker_count(t_pool)
    train_time = Tt / t + own
    if not plan.tag or Rr / r <= train_time:
        return max(Rr / r, train_time)
    x = ((Rt + Tt) / t + own) / (Rr / r + Rt / t)  # share of the rollout the rollout pool does
    return max(train_time, x * Rr / r)
