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
    if placement != "disaggregated":
        return (
            f"sharded trainer ranks need placement.mode: disaggregated (got {placement}); use train.fsdp: off"
        )
    if ranks % n:
        return f"must divide the number of trainer ranks ({ranks}); use train.fsdp: {ranks} or off"
    refused = {
        "engine.tag": tag,
        "engine.tsp_degree > 1": tsp_degree > 1,
        "algorithm.timesteps.mode: random": timestep_mode == "random",
    }
    for name, on in refused.items():
        if on:
            return (
                f"not with {name} (every FSDP rank must run the same forward / backward passes; the sharded "
                "group trains whole units together)"
            )
    if trainer_sp > 1 and ranks != n:
        return (
            f"HSDP (a degree below the {ranks} trainer ranks) with engine.trainer_sp is not wired; "
            f"use train.fsdp: {ranks}"
        )
    slices = n // trainer_sp if n % trainer_sp == 0 else n  # engine.trainer_sp: a group trains one slice
    uneven = _uneven_unit_share(slices, unit_groups, unit_samples, group_size, optimizer_steps)
    over = f"the {n} ranks" if slices == n else f"the {slices} sequence-parallel groups of the {n} ranks"
    return f"{uneven} must split evenly over {over}" if uneven else None


def _uneven_unit_share(n: int, unit_groups: int, unit_samples: int, group: int, steps: int) -> str | None:
    """What does not split over ``n`` sharded ranks: a unit's samples, or (mini-batch PPO) the samples
    of one of its mini-batches (those with in-group index in s*G/S .. (s+1)*G/S - 1); None if all do."""
    per_unit = unit_samples or unit_groups * group
    what = (
        "engine.unit_samples"
        if unit_samples
        else f"engine.unit_groups x algorithm.group_size ({unit_groups} x {group})"
    )
    if per_unit % n:
        return f"{what}: {per_unit} samples per unit"
    if steps <= 1 or group % steps:
        return None
    span, width = group // steps, unit_samples or group  # a mini-batch's / a unit's in-group indices
    groups = 1 if unit_samples else unit_groups
    for lo in range(0, group, width):  # every unit's share of every mini-batch
        for s in range(steps):
            rows = groups * max(0, min(lo + width, (s + 1) * span) - max(lo, s * span))
            if rows % n:
                return (
                    f"train.optimizer_steps: {steps}: a unit holds {rows} sample(s) of mini-batch {s}, which"
                )
    return None


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
    if placement != "disaggregated":
        return (
            f"sequence-parallel workers need placement.mode: disaggregated (got {placement}); "
            f"use engine.{role}_sp: 1"
        )
    refused = {"engine.tag": tag, "engine.faults": faults}
    if role == "trainer":
        refused["output.eval_every"] = evaluates
    for name, on in refused.items():
        if on:
            return f"not with {name} (sequence-parallel {role} workers do not run it yet)"
    if devices % s:
        return f"must divide the {devices} {role} devices"
    if shape is None:
        return None
    from digenrl.distributed.sequence_parallel import sp_problem

    shape = shape() if callable(shape) else shape
    return sp_problem(shape.transformer_class, shape.config, shape.tokens.x, shape.tokens.text, s)
