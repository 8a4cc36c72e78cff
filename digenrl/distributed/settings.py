"""The combinations of sharding (``train.fsdp``) and sequence parallelism (``engine.rollout_sp`` /
``trainer_sp``) that mean nothing, as pure functions of the settings: every other combination runs
(docs/distributed.md, "What is refused, and why"). :func:`digenrl.placement.resolve.resolve` evaluates them
once per run (with ``auto`` already resolved by the memory model) and the planner's search
(``planner/search.py``) never builds a plan they refuse.
"""

from __future__ import annotations


def fsdp_refusal(n: int, *, placement: str, ranks: int, trainer_sp: int = 1) -> str | None:
    """Why sharding degree ``n`` > 1 means nothing with these settings, or None. Shard groups are ``n``
    consecutive trainer devices (HSDP, replicated across the groups, when there are several), each
    group training each of its units together: so a single process (``placement.mode: local``) has
    nothing to shard over, ``n`` must divide the ``ranks`` trainer devices, and a shard group must
    hold whole sequence-parallel groups (``n`` a multiple of ``trainer_sp``: an SP group's devices
    hold one sample's tokens between them)."""
    if placement == "local":
        return (
            f"sharded trainer ranks need placement.mode: disaggregated or colocated (got {placement}); "
            "use train.fsdp: off"
        )
    if ranks % n:
        return f"must divide the number of trainer ranks ({ranks}); use train.fsdp: {ranks} or off"
    if n % trainer_sp:
        return (
            f"must be a multiple of engine.trainer_sp ({trainer_sp}): a shard group holds whole "
            "sequence-parallel groups"
        )
    return None


def node_refusal(n: int, gpus_per_node: int, ranks: int, trainer_sp: int = 1) -> str | None:
    """Why shard groups of ``n`` devices cannot be placed on nodes of ``gpus_per_node`` GPUs, or None:
    a shard group's devices share a node (its collectives run every forward), so a wider one is HSDP's
    to split -- shard groups within a node, replicated across nodes."""
    if n <= gpus_per_node:
        return None
    fits = [d for d in range(gpus_per_node, 1, -1) if ranks % d == 0 and d % trainer_sp == 0]
    hint = f"use train.fsdp: {fits[0]} (HSDP: {ranks // fits[0]} replica groups of {fits[0]})" if fits else ""
    return (
        f"a shard group must fit one node of {gpus_per_node} GPUs (a plain FSDP group of {n} spans "
        f"nodes and can never be placed); {hint or 'use train.fsdp: off'}"
    )


def sp_refusal(role: str, s: int, *, placement: str, devices: int, shape=None) -> str | None:
    """Why sequence-parallel ``role`` workers ("rollout" / "trainer") of ``s`` devices mean nothing, or
    None: a single process has no group to split a sequence over, ``s`` must divide the role's
    ``devices``, and the model's heads / tokens (``shape``: a ModelShape, or a function returning one;
    None skips that check: Ulysses hands each device whole heads of every token)."""
    if s == 1:
        return None
    if placement == "local":
        return (
            f"sequence-parallel workers need placement.mode: disaggregated or colocated (got {placement}); "
            f"use engine.{role}_sp: 1"
        )
    if devices % s:
        return f"must divide the {devices} {role} devices"
    if shape is None:
        return None
    from digenrl.distributed.sequence_parallel import sp_problem

    shape = shape() if callable(shape) else shape
    return sp_problem(shape.transformer_class, shape.config, shape.tokens.x, shape.tokens.text, s)
