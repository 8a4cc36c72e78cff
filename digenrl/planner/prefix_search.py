"""The plan search at each shared-prefix length (``algorithm.shared_prefix``): offered beside the
best plan, never chosen silently (it changes the trained steps)."""

from __future__ import annotations

from dataclasses import replace

from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import ClusterSpec
from digenrl.planner.search import SearchResult, search


def search_shared_prefix(
    cost: CostModel, cluster: ClusterSpec, prefixes=(0, 1, 2), **kw
) -> dict[int, SearchResult]:
    """The search at each ``algorithm.shared_prefix`` k (a group's first k rollout steps run once per
    group, docs/algorithms.md): the same plans, priced with the (G - 1) x k forwards per group saved.
    A prefix changes the trained steps (the algorithm), so it is offered, never chosen silently."""
    w = cost.workload
    out = {}
    for k in (k for k in prefixes if k < w.steps):
        priced = CostModel(
            # a branched group keeps its KL reference on the trainer (kl_reference rollout refuses it)
            replace(w, shared_prefix=k, kl_reference=w.kl_reference if not k else "train"),
            cost.cluster,
            cost.params,
            cost.colocation,
            cost.overheads,
            cost.profile,
        )
        out[k] = search(priced, cluster, **kw)
    return out
