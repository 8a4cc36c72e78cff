"""How ``train.fsdp`` and ``train.activation_checkpointing`` resolve to what a trainer does.

Explicit values are taken as written. ``auto`` is what the memory preflight resolves
(:func:`digenrl.preflight.resolve_memory_settings`, the planner's memory model): on a known GPU
type, replicated without checkpointing if that fits, else the first FSDP degree / checkpointing
setting that does; on CPU pools (no fixed per-device memory) and local runs, off. The runtime and
the preflight call the same function, so what ``config validate`` accepted is what ``train`` runs.
"""

from __future__ import annotations

from digenrl.errors import UserError


def _auto(cfg):
    from digenrl.preflight import resolve_memory_settings

    return resolve_memory_settings(cfg)


def resolve_activation_checkpointing(cfg) -> bool:
    """Whether trainer ranks checkpoint activations per block (``auto``: the memory preflight's choice)."""
    value = cfg.train.activation_checkpointing
    if value == "auto":
        return cfg.placement.mode != "local" and _auto(cfg).activation_checkpointing
    return value == "on"


def resolve_fsdp(cfg, trainer_ranks: int) -> int:
    """The sharding degree: 1 = replicated (DDP-style bucketed all-reduce), N = FSDP2 over groups
    of N ranks (HSDP, replicated across the groups, when N < ``trainer_ranks``); ``auto``: the
    memory preflight's choice."""
    value = cfg.train.fsdp
    if value == "auto":
        value = _auto(cfg).fsdp if cfg.placement.mode != "local" else 1
    if value in ("auto", "off", 1):
        return 1
    if trainer_ranks % value:
        raise UserError(f"train.fsdp: {value} does not divide the {trainer_ranks} trainer ranks")
    return value


def check_fsdp_wired(cfg) -> None:
    """What ``train.fsdp: N`` (N > 1) is wired for (:func:`fsdp_unwired`); anything else is refused
    with one line."""
    n = cfg.train.fsdp
    head = f"train.fsdp: {n}:"
    if n == "auto" and cfg.placement.mode != "local":
        n = _auto(cfg).fsdp
        head = f"train.fsdp: auto (the memory preflight needs {n}):"
    if not (isinstance(n, int) and n > 1):
        return
    from digenrl.placement import engine_workers

    e, mode = cfg.engine, cfg.placement.mode
    ranks = sum(w.role != "rollout" for w in engine_workers(cfg)) if mode != "local" else 0
    why = fsdp_unwired(
        n,
        placement=mode,
        ranks=ranks,
        tag=e.tag,
        tsp_degree=e.tsp_degree,
        timestep_mode=cfg.algorithm.timesteps.mode,
        unit_groups=e.unit_groups,
        unit_samples=e.unit_samples,
        group_size=cfg.algorithm.group_size,
        optimizer_steps=cfg.train.optimizer_steps,
        trainer_sp=e.trainer_sp,
    )
    if why:
        raise UserError(f"{head} {why}")


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
    runtime (:func:`check_fsdp_wired`) and the planner (``planner/search.py``) share: disaggregated
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


def check_sp_wired(cfg) -> None:
    """What sequence parallelism is wired for (:func:`sp_unwired`): ``engine.rollout_sp: s`` makes
    each s consecutive devices of a disaggregated rollout pool one rollout worker, ``engine.trainer_sp:
    s`` each s consecutive trainer devices one trainer rank (a lead and s - 1 hidden followers running
    the transformer with Ulysses over their group). Anything else: one line."""
    from digenrl.planner.shapes import model_shape

    e, mode = cfg.engine, cfg.placement.mode
    pools = {p.name: p.count for p in cfg.cluster.pools}
    devices = {
        "rollout": pools.get(cfg.placement.rollout_pool, 0),
        "trainer": pools.get(cfg.placement.trainer_pool, 0),
    }
    if mode == "colocated":  # every device rolls out and trains, in groups of engine.trainer_sp
        devices = dict.fromkeys(devices, sum(pools.values()))
    for key, role in (("rollout_sp", "rollout"), ("trainer_sp", "trainer")):
        s = getattr(e, key)
        shape = (lambda: model_shape(cfg.model)) if s > 1 else None
        why = sp_unwired(
            role,
            s,
            placement=mode,
            devices=devices[role],
            tag=e.tag,
            faults=bool(e.faults),
            evaluates=cfg.output.eval_every > 0,
            shape=shape,
        )
        if why:
            raise UserError(f"engine.{key}: {s}: {why}")


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
    devices, or None. The rule the runtime (:func:`check_sp_wired`) and the planner
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
