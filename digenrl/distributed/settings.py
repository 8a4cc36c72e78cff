"""What sharding (``train.fsdp``) and sequence parallelism (``engine.rollout_sp`` / ``trainer_sp``) the
engine runs: the refusal rules, as pure functions of the settings. :func:`digenrl.resolve.resolve`
evaluates them once per run (with ``auto`` already resolved by the memory model) and the planner's
search (``planner/search.py``) never proposes what they refuse.
"""

from __future__ import annotations


def fsdp_unwired(
    n: int,
    *,
    placement: str,
    ranks: int,
    tag: bool,
    tsp_degree: int,
    timestep_mode: str,
    unit_groups: int,
    unit_samples: int,
    group_size: int,
    optimizer_steps: int,
    trainer_sp: int = 1,
) -> str | None:
    """Why the engine cannot run sharding degree ``n`` > 1 with these settings, or None. The rule the
    runtime (:func:`digenrl.resolve.fsdp_degree`) and the planner (``planner/search.py``) share: disaggregated
    trainer ranks in shard groups of ``n`` (``n`` divides them: HSDP, replicated across the groups,
    when there are several), each group training each of its units together (every rank an equal
    slice of its samples -- of each mini-batch's samples with ``optimizer_steps`` > 1 -- so every
    rank of the group runs the same forward / backward passes)."""
    if placement == "local":
        return (
            f"sharded trainer ranks need placement.mode: disaggregated or colocated (got {placement}); "
            "use train.fsdp: off"
        )
    if ranks % n:
        return f"must divide the number of trainer ranks ({ranks}); use train.fsdp: {ranks} or off"
    return None  # an uneven unit share: the ranks with fewer samples run zero-weighted passes


def sp_unwired(
    role: str,
    s: int,
    *,
    placement: str,
    devices: int,
    tag: bool,
    faults: bool = False,
    evaluates: bool = False,
    shape=None,
) -> str | None:
    """Why the engine cannot run sequence-parallel ``role`` workers ("rollout" / "trainer") of ``s``
    devices, or None. The rule the runtime (:func:`digenrl.resolve.check_sp`) and the planner
    (``planner/search.py``) share: disaggregated placements only, not beside TAG or fault injection
    (nor, for trainers, eval, which rank 0 would run alone), ``s`` dividing the role's ``devices``
    and the model's heads / tokens (``shape``: a ModelShape, or a function returning one; None skips
    that check)."""
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
