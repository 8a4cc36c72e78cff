"""Enumerate placements of a cluster, keep those that fit in memory, simulate, rank (docs/architecture.md).

Candidates:

- colocated on every device of the cluster (and, on a mixed cluster, on the devices of each type
  alone), for every GAP unit size ``m`` (divisors of ``prompts_per_iteration``) and TSP degree
  (1, 2, 4 <= devices);
- disaggregated: a rollout pool of one device type and a trainer pool of one type (the runtime
  runs one rollout pool and one trainer pool): two different types use all their devices; one type
  is split ``r + t = n`` in every way; x ``m`` x TSP degree (1, 2, 4 <= t) x TAG on/off x
  ``max_staleness`` 0/1, with GAP on.

Pruning: a candidate whose memory does not fit is dropped (its reason is kept, for the error when
nothing fits); the others are simulated in order of their throughput bound (a lower bound on the
iteration time that costs no simulation), and the search stops once the next bound cannot beat the
K-th best simulated plan. The best colocated plan is always simulated: speedups are against it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from digenrl.config import PoolConfig
from digenrl.errors import UserError
from digenrl.placement import Plan
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import ClusterSpec
from digenrl.planner.simulator import DoesNotFit, SimResult, bound, setups, simulate

TSP_DEGREES = (1, 2, 4)


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


def candidates(cluster: ClusterSpec, prompts: int, *, colocated: bool = True, gap=(True,), tsp=TSP_DEGREES,
               tag=(False, True), staleness=(0, 1)) -> list[Plan]:
    units = divisors(prompts)
    plans = []
    if colocated:  # on every device, and (mixed clusters) on the devices of one type
        groups = [tuple(cluster.pools)]
        if len(cluster.devices) > 1:
            groups += [tuple(p for p in cluster.pools if p.device == d) for d in cluster.devices]
        for pools in groups:
            n = sum(p.count for p in pools)
            plans += [Plan("colocated", pools, m, D) for m in units for D in tsp if D <= n]
    for (dr, r), (dt, t) in pool_splits(cluster):
        pools = (PoolConfig(name="rollout", device=dr, count=r), PoolConfig(name="trainer", device=dt, count=t))
        plans += [Plan("disaggregated", pools, m, D, tg, g, st)
                  for m in units for D in tsp if D <= t for tg in tag for g in gap for st in staleness]
    return plans


@dataclass
class SearchResult:
    ranked: list[SimResult]  # best first (disaggregated and colocated together)
    best_colocated: SimResult | None
    candidates: int
    rejected: dict[str, tuple] = field(default_factory=dict)  # plan label -> (why it does not fit, need / have)
    simulated: int = 0
    seconds: float = 0.0

    def speedup(self, r: SimResult) -> float | None:
        if self.best_colocated is None or not self.best_colocated.samples_per_s:
            return None
        return r.samples_per_s / self.best_colocated.samples_per_s


def search(cost: CostModel, cluster: ClusterSpec, top: int = 5, iterations: int = 4,
           wait_for_full_batch: bool = False, plans: list[Plan] | None = None) -> SearchResult:
    start = time.perf_counter()
    plans = plans if plans is not None else candidates(cluster, cost.w.prompts)
    fitting, rejected = [], {}
    setup_cache: dict = {}
    for plan in plans:
        key = (plan.placement, plan.pools, plan.unit_groups, plan.tag)
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
        fitting.append((bound(plan, cost, s), plan))
    if not fitting:
        why, _ = min(rejected.values(), key=lambda r: r[1])  # the placement that came closest
        w = cost.w
        weights = w.params.total * w.dtype_bytes / 2**30
        raise UserError(f"{w.shape.source} fits no placement of cluster {cluster.name} ({cluster.describe()}): "
                        f"its weights alone are {weights:.1f} GiB; the closest placement: {why}")
    fitting.sort(key=lambda bp: (bp[0], bp[1].label()))

    def run(plan: Plan) -> SimResult:
        return simulate(plan, cost, iterations, wait_for_full_batch=wait_for_full_batch)

    results: list[SimResult] = []
    best_col: SimResult | None = None
    simulated = 0
    for b, plan in fitting:
        times = sorted(r.iteration_s for r in results)
        beaten_top = len(times) >= top and b > times[top - 1]
        beaten_col = best_col is not None and b > best_col.iteration_s
        if plan.placement == "colocated":
            if beaten_top and beaten_col:
                continue
        elif beaten_top:
            continue
        r = run(plan)
        simulated += 1
        results.append(r)
        if plan.placement == "colocated" and (best_col is None or r.iteration_s < best_col.iteration_s):
            best_col = r
    results.sort(key=lambda r: (-r.samples_per_s, r.plan.label()))
    return SearchResult(results, best_col, len(plans), rejected, simulated, time.perf_counter() - start)


#: what each knob adds: the best plan with the knobs up to that line (the knob table of docs/architecture.md)
LADDER = (
    ("sync", dict(gap=(False,), tsp=(1,), tag=(False,), staleness=(0,))),
    ("+GAP", dict(gap=(True,), tsp=(1,), tag=(False,), staleness=(0,))),
    ("+TSP", dict(gap=(True,), tsp=TSP_DEGREES, tag=(False,), staleness=(0,))),
    ("+TAG", dict(gap=(True,), tsp=TSP_DEGREES, tag=(False, True), staleness=(0,))),
    ("+async", dict(gap=(True,), tsp=TSP_DEGREES, tag=(False, True), staleness=(0, 1))),
)


def ladder(cost: CostModel, cluster: ClusterSpec, iterations: int = 4,
           wait_for_full_batch: bool = False) -> list[tuple[str, SimResult | None]]:
    """The best disaggregated plan as GAP, TSP, TAG and one-step async are switched on one by one
    (each line may pick another pool split and unit size)."""
    out = []
    for name, knobs in LADDER:
        plans = candidates(cluster, cost.w.prompts, colocated=False, **knobs)
        try:
            res = search(cost, cluster, top=1, iterations=iterations, plans=plans,
                         wait_for_full_batch=wait_for_full_batch)
            out.append((name, res.ranked[0] if res.ranked else None))
        except UserError:
            out.append((name, None))
    return out
