"""Enumerate placements of a cluster, keep those that fit in memory, simulate, rank (docs/architecture.md).

Details: docs/modules.md, `digenrl.planner.search`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from digenrl.config.engine import PoolConfig
from digenrl.distributed.settings import fsdp_refusal, node_refusal, sp_refusal
from digenrl.errors import UserError
from digenrl.placement.plan import Plan, spread_units
from digenrl.planner import peers as peer_models
from digenrl.planner.bound import DoesNotFit, bound, pairs_shorten, setups
from digenrl.planner.costmodel import CostModel
from digenrl.planner.elastic_search import elastic_twins
from digenrl.planner.gpus import ClusterSpec
from digenrl.planner.pair_times import pair_sizes
from digenrl.planner.sim_result import SimResult
from digenrl.planner.simulator import simulate

TSP_DEGREES = (1, 2, 4)
SP_DEGREES = (1, 2, 4, 8)


def sp_degrees(cost: CostModel, cluster: ClusterSpec) -> tuple[int, ...]:
    """Sequence-parallel degrees worth trying: for a video model, those of :data:`SP_DEGREES` inside one
    node (the all-to-alls stay on the node's links); an image model's few thousand tokens gain nothing,
    and logical CPU devices share one host's cores."""
    if not cost.workload.video or cluster.is_cpu:
        return (1,)
    return tuple(d for d in SP_DEGREES if d <= max(1, cluster.gpus_per_node))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pool_splits(cluster: ClusterSpec) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """((rollout type, count), (trainer type, count)) for every disaggregated split."""
    devices = cluster.devices
    out = []
    for dr, nr in devices.items():
        for dt, nt in devices.items():
            if dr != dt:
                out.append(((dr, nr), (dt, nt)))
            else:
                out += [((dr, r), (dt, nr - r)) for r in range(1, nr)]
    return out


def unit_shapes(
    prompts: int, group_size: int, devices: int, sub_groups: bool = True
) -> list[tuple[int, int]]:
    """(unit_groups, group_parts) to try on ``devices`` devices that roll out: every unit size of whole
    groups, and, with fewer groups than devices, parts of one group up to the fewest parts that give
    every device a unit."""
    shapes = [(m, 1) for m in divisors(prompts)]
    if sub_groups and prompts < devices:
        _, most = spread_units(prompts, 1, group_size, devices)
        shapes += [(1, p) for p in divisors(group_size) if 1 < p <= most]
    return shapes


def candidates(
    cluster: ClusterSpec,
    prompts: int,
    *,
    group_size: int = 1,
    colocated: bool = True,
    disaggregated: bool = True,
    sub_groups: bool = True,
    gap=(True,),
    tsp=TSP_DEGREES,
    tag=(False, True),
    staleness=(0, 1),
    sp=(1,),
    pairs=(None,),
) -> list[Plan]:
    """Every plan at these knob values (``pairs``: ``train.pair_batch``'s, ``pair_times.pair_sizes``)."""
    plans = []
    if colocated:  # on every device, and (mixed clusters) on the devices of one type
        groups = [tuple(cluster.pools)]
        if len(cluster.devices) > 1:
            groups += [tuple(p for p in cluster.pools if p.device == d) for d in cluster.devices]
        for pools in groups:
            for q in (q for q in sp if all(p.count % q == 0 for p in pools)):
                n = sum(p.count for p in pools) // q
                plans += [
                    Plan(
                        placement="colocated",
                        pools=pools,
                        unit_groups=m,
                        tsp_degree=D,
                        group_parts=parts,
                        rollout_sp=q,
                        trainer_sp=q,
                        pair_batch=pb,
                    )
                    for m, parts in unit_shapes(prompts, group_size, n, sub_groups)
                    for D in tsp
                    if D <= n
                    for pb in pairs
                ]
    for (dr, r), (dt, t) in pool_splits(cluster) if disaggregated else []:
        pools = (
            PoolConfig(name="rollout", device=dr, count=r),
            PoolConfig(name="trainer", device=dt, count=t),
        )
        for qr in (q for q in sp if r % q == 0):
            for qt in (q for q in sp if t % q == 0):
                plans += [
                    Plan(
                        placement="disaggregated",
                        pools=pools,
                        unit_groups=m,
                        tsp_degree=D,
                        tag=tg,
                        gap=g,
                        max_staleness=st,
                        group_parts=parts,
                        rollout_sp=qr,
                        trainer_sp=qt,
                        pair_batch=pb,
                    )
                    for m, parts in unit_shapes(prompts, group_size, r // qr, sub_groups)
                    for D in tsp
                    if D <= t // qt
                    for tg in tag
                    for g in gap
                    for st in staleness
                    for pb in pairs
                ]
    return plans


def refused_plan(plan: Plan, setups_: dict, cost: CostModel) -> str | None:
    """Why the plan means nothing to the engine -- its sequence parallelism (:func:`refused_sp`), or the
    FSDP degree the memory model chose for its trainer devices
    (:func:`~digenrl.distributed.settings.fsdp_refusal`, the runtime's own rule; the degree and
    ``ranks`` count trainer devices, sequence-parallel groups inside) -- or None. ``candidates``
    builds no such plan; a peer's arrangement may be one."""

    why = refused_sp(plan, cost)
    if why:
        return why
    for pool in plan.trainer_pools:
        shard = setups_[pool.name].shard
        ranks = plan.ranks * plan.trainer_sp
        why = shard > 1 and (
            fsdp_refusal(shard, placement=plan.placement, ranks=ranks, trainer_sp=plan.trainer_sp)
            or (
                not cost.cluster.is_cpu
                and node_refusal(shard, cost.cluster.gpus_per_node, ranks, plan.trainer_sp)
            )
        )
        if why:
            return f"its {pool.name} ranks need train.fsdp {shard}, which the engine refuses: {why}"
    return None


def refused_sp(plan: Plan, cost: CostModel) -> str | None:
    """Why the plan's ``rollout_sp`` / ``trainer_sp`` mean nothing -- the runtime's own rule
    (:func:`~digenrl.distributed.settings.sp_refusal`) -- or None."""

    for key, role, s in (
        ("rollout_sp", "rollout", plan.rollout_sp),
        ("trainer_sp", "trainer", plan.trainer_sp),
    ):
        pools = (
            [plan.rollout_pool]
            if role == "rollout" and plan.placement == "disaggregated"
            else plan.trainer_pools
        )
        devices = sum(p.count for p in pools)
        why = sp_refusal(role, s, placement=plan.placement, devices=devices, shape=cost.workload.shape)
        if why:
            return f"engine.{key}: {s}, which the engine refuses: {why}"
    return None


@dataclass
class SearchResult:
    ranked: list[SimResult]  # best first (disaggregated and colocated together)
    best_colocated: SimResult | None
    candidates: int
    rejected: dict[str, tuple] = field(
        default_factory=dict
    )  # plan label -> (why it does not fit, need / have)
    simulated: int = 0
    seconds: float = 0.0
    best_colocated_whole_groups: SimResult | None = (
        None  # the earlier baseline: colocated units of whole groups
    )

    def speedup(self, r: SimResult) -> float | None:
        if self.best_colocated is None or not self.best_colocated.samples_per_s:
            return None
        return r.samples_per_s / self.best_colocated.samples_per_s


def search(
    cost: CostModel,
    cluster: ClusterSpec,
    top: int = 5,
    iterations: int = 4,
    wait_for_full_batch: bool = False,
    plans: list[Plan] | None = None,
    elastic: bool | None = None,
) -> SearchResult:
    """Rank the plans (``candidates`` by default), dropping those that do not fit or mean nothing
    (:func:`refused_plan`), with (``elastic``; default: without ``plans``) the ``tag: auto`` twins of
    the best (:func:`~digenrl.planner.elastic_search.elastic_twins`)."""
    start, elastic = time.perf_counter(), plans is None if elastic is None else elastic
    plans = (
        plans
        if plans is not None
        else candidates(
            cluster,
            cost.workload.prompts,
            group_size=cost.workload.group_size,
            sp=sp_degrees(cost, cluster),
            pairs=pair_sizes(cost.workload),
        )
    )
    fitting, rejected = [], {}
    setup_cache: dict = {}
    for plan in plans:
        key = (plan.placement, plan.pools, plan.unit_size, bool(plan.tag), plan.rollout_sp, plan.trainer_sp)
        key += (plan.pair_batch,)
        try:
            if key not in setup_cache:
                setup_cache[key] = setups(plan, cost)
            s = setup_cache[key]
        except DoesNotFit as exc:
            setup_cache[key] = exc
            rejected[plan.label()] = exc.args
            continue
        if isinstance(s, DoesNotFit):
            rejected[plan.label()] = s.args
            continue
        plain = setup_cache.get(key[:-1] + (None,))
        if plan.pair_batch and isinstance(plain, dict) and not pairs_shorten(plan, cost, s, plain):
            continue  # pair batches that save nothing: the per-step plan (exact ratio) is as fast
        why = refused_plan(plan, s, cost)
        if why:  # the runtime would refuse it (resolve.check_sp / fsdp_degree): never proposed
            rejected[plan.label()] = (why, float("inf"))
            continue
        fitting.append((bound(plan, cost, s), plan))
    if not fitting:
        if not rejected:  # no placement of this kind at all (e.g. a disaggregated one on 1 device)
            raise UserError(f"cluster {cluster.name} ({cluster.describe()}) has no placement of this kind")
        why, _ = min(rejected.values(), key=lambda r: r[1])  # the placement that came closest
        w = cost.workload
        weights = w.params.total * w.dtype_bytes / 2**30
        raise UserError(
            f"{w.shape.source} fits no placement of cluster {cluster.name} ({cluster.describe()}): "
            f"its weights alone are {weights:.1f} GiB; the closest placement: {why}"
            + _would_fit(cost, cluster, plans)
        )
    fitting.sort(key=lambda bp: (bp[0], bp[1].label()))

    def run(plan: Plan) -> SimResult:
        return simulate(plan, cost, iterations, wait_for_full_batch=wait_for_full_batch)

    results: list[SimResult] = []
    best_col: dict[bool, SimResult] = {}  # whole groups? -> the best colocated plan of that kind
    simulated = 0
    for b, plan in fitting:
        times = sorted(r.iteration_s for r in results)
        beaten_top = len(times) >= top and b > times[top - 1]
        if plan.placement == "colocated":  # both kinds of colocated plan are always found (the baselines)
            mine = best_col.get(plan.group_parts == 1)
            if beaten_top and mine is not None and b > mine.iteration_s:
                continue
        elif beaten_top:
            continue
        r = run(plan)
        simulated += 1
        results.append(r)
        whole = plan.group_parts == 1
        if plan.placement == "colocated" and (
            whole not in best_col or r.iteration_s < best_col[whole].iteration_s
        ):
            best_col[whole] = r
    if elastic:  # tag: auto, for the best plans only (elastic_search.py)
        twins = elastic_twins(results, run, lambda p: refused_plan(p, setups(p, cost), cost), top)
        results, simulated = results + twins, simulated + len(twins)
    results.sort(key=lambda r: (-r.samples_per_s, r.plan.label()))
    best = min(best_col.values(), key=lambda r: r.iteration_s, default=None)
    return SearchResult(
        results, best, len(plans), rejected, simulated, time.perf_counter() - start, best_col.get(True)
    )


#: what each knob adds: the best plan with the knobs up to that line (the knob table of docs/architecture.md)
LADDER = (
    ("sync", dict(gap=(False,), tsp=(1,), tag=(False,), staleness=(0,))),
    ("+GAP", dict(gap=(True,), tsp=(1,), tag=(False,), staleness=(0,))),
    ("+TSP", dict(gap=(True,), tsp=TSP_DEGREES, tag=(False,), staleness=(0,))),
    ("+TAG", dict(gap=(True,), tsp=TSP_DEGREES, tag=(False, True), staleness=(0,))),
    ("+async", dict(gap=(True,), tsp=TSP_DEGREES, tag=(False, True), staleness=(0, 1))),
)


def ladder(
    cost: CostModel, cluster: ClusterSpec, iterations: int = 4, wait_for_full_batch: bool = False
) -> list[tuple[str, SimResult | None]]:
    """The best disaggregated plan as GAP, TSP, TAG and one-step async are switched on one by one
    (each line may pick another pool split and unit size)."""
    out = []
    for name, knobs in LADDER:
        plans = candidates(
            cluster,
            cost.workload.prompts,
            group_size=cost.workload.group_size,
            colocated=False,
            sp=sp_degrees(cost, cluster),
            **knobs,
        )
        try:
            res = search(cost, cluster, 1, iterations, wait_for_full_batch, plans)
            out.append((name, res.ranked[0] if res.ranked else None))
        except UserError:
            out.append((name, None))
    return out


#: the peers' arrangements, as candidate filters: the best plan of each is that baseline
BASELINES = {
    "colocated": dict(disaggregated=False),  # veRL-Omni / DanceGRPO colocation: samples over every rank
    "colocated_whole_groups": dict(
        disaggregated=False, sub_groups=False, sp=(1,)
    ),  # this planner's earlier baseline
    "separate_async": dict(colocated=False, gap=(False,), tsp=(1,), tag=(False,), staleness=(1,)),
}


def _would_fit(cost: CostModel, cluster: ClusterSpec, plans: list[Plan]) -> str:
    """What the user can set that makes a plan fit, for the refusal's line: the text encoders on the
    CPU (``model.offload_text_encoders``), when they are what does not fit; else ""."""
    w = cost.workload
    if w.text_offload or not w.shape.text_encoder_params:
        return ""
    offloaded = CostModel(
        replace(w, text_offload=True), cluster, cost.params, cost.colocation, cost.overheads, cost.profile
    )
    try:
        best = search(offloaded, cluster, top=1, iterations=2, plans=plans).ranked[0]
    except UserError:
        return ""
    return f"; with model.offload_text_encoders: true it fits ({best.plan.where()}, {best.plan.knobs()})"


def baselines(
    cost: CostModel,
    cluster: ClusterSpec,
    iterations: int = 4,
    wait_for_full_batch: bool = False,
    sp: tuple[int, ...] | None = None,
) -> dict[str, SimResult | None]:
    """The best plan of each peer arrangement (:data:`BASELINES`), as the peers run it (with the FSDP
    its memory needs and sequence parallelism -- DanceGRPO's ``sp_size`` -- at the degrees ``sp``,
    default :func:`sp_degrees`, in any placement; the earlier whole-group baseline never uses it):
    a plan DigenRL's engine runs, so :func:`search` considers it too; None where none fits."""
    out = {}
    for name, knobs in BASELINES.items():
        knobs = {"sp": sp or sp_degrees(cost, cluster), **knobs}
        plans = candidates(cluster, cost.workload.prompts, group_size=cost.workload.group_size, **knobs)
        try:
            res = search(
                cost,
                cluster,
                top=1,
                iterations=iterations,
                plans=plans,
                wait_for_full_batch=wait_for_full_batch,
            )
            out[name] = res.ranked[0] if res.ranked else None
        except UserError:
            out[name] = None
    return out


#: the peers as they run (digenrl.planner.peers): what a user of each peer pays today
PEERS = peer_models.NAMES


def peers(cost: CostModel, cluster: ClusterSpec) -> dict[str, peer_models.PeerRun]:
    """Each peer of :data:`PEERS` running this workload on this cluster, phase by phase, with the same
    per-call times (kernel efficiencies, FLOPs, bandwidths) as DigenRL's plans."""
    return peer_models.peers(cost, cluster)
