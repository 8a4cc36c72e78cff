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
    """What ``train.fsdp: N`` (N > 1) is wired for: the engine's disaggregated trainer group of
    exactly N ranks, training each unit together (every rank an equal slice of its samples, so
    every rank runs the same forward / backward passes). Anything else is refused."""
    n = cfg.train.fsdp
    head = f"train.fsdp: {n}:"
    if n == "auto" and cfg.placement.mode != "local":
        n = _auto(cfg).fsdp
        head = f"train.fsdp: auto (the memory preflight needs {n}):"
    if not (isinstance(n, int) and n > 1):
        return
    if cfg.placement.mode != "disaggregated":
        raise UserError(f"{head} sharded trainer ranks need placement.mode: disaggregated "
                        f"(got {cfg.placement.mode}); use train.fsdp: off")
    from digenrl.placement import engine_workers

    ranks = sum(w.role == "trainer" for w in engine_workers(cfg))
    if ranks != n:
        raise UserError(f"{head} must equal the number of trainer ranks ({ranks}); HSDP (a degree that divides "
                        f"them) is not wired; use train.fsdp: {ranks} or off")
    refused = {"engine.tag": cfg.engine.tag, "engine.tsp_degree > 1": cfg.engine.tsp_degree > 1,
               "algorithm.timesteps.mode: random": cfg.algorithm.timesteps.mode == "random",
               "output.eval_every": cfg.output.eval_every > 0,
               "train.optimizer_steps > 1": cfg.train.optimizer_steps > 1, "train.ema": cfg.train.ema is not None}
    for name, on in refused.items():
        if on:
            raise UserError(f"{head} not with {name} (every FSDP rank must run the same forward / backward "
                            "passes; the sharded group trains whole units together)")
    e, group = cfg.engine, cfg.algorithm.group_size
    per_unit = e.unit_samples or e.unit_groups * group
    slices = n // e.trainer_sp if n % e.trainer_sp == 0 else n  # engine.trainer_sp: a group trains one slice
    if per_unit % slices:
        what = ("engine.unit_samples" if e.unit_samples else "engine.unit_groups x algorithm.group_size "
                f"({e.unit_groups} x {group})")
        over = f"the {n} ranks" if slices == n else f"the {slices} sequence-parallel groups of the {n} ranks"
        raise UserError(f"{head} {what}: {per_unit} samples per unit must split evenly over {over}")


def check_sp_wired(cfg) -> None:
    """What sequence parallelism is wired for, in a disaggregated engine run: ``engine.rollout_sp: s``
    makes each s consecutive devices of the rollout pool one rollout worker, ``engine.trainer_sp:
    s`` each s consecutive trainer devices one trainer rank (a lead and s - 1 hidden followers
    running the transformer with Ulysses over their group). Other combinations: one line each."""
    from digenrl.placement import engine_workers

    for key, role in (("rollout_sp", "rollout"), ("trainer_sp", "trainer")):
        s = getattr(cfg.engine, key)
        if s == 1:
            continue
        head = f"engine.{key}: {s}:"
        if cfg.placement.mode != "disaggregated":
            raise UserError(f"{head} sequence-parallel workers need placement.mode: disaggregated "
                            f"(got {cfg.placement.mode}); use engine.{key}: 1")
        refused = {"engine.tag": cfg.engine.tag, "engine.faults": bool(cfg.engine.faults)}
        if role == "trainer":  # rank 0 would evaluate alone
            refused["output.eval_every"] = cfg.output.eval_every > 0
        for name, on in refused.items():
            if on:
                raise UserError(f"{head} not with {name} (sequence-parallel {role} workers do not run it yet)")
        devices = sum(w.role == role for w in engine_workers(cfg))
        if devices % s:
            raise UserError(f"{head} must divide the {devices} {role} devices")
        _check_model_splits(cfg, head, s)


def _check_model_splits(cfg, head: str, s: int) -> None:
    """The model's heads and tokens per sample must divide by the sequence-parallel degree."""
    from digenrl.distributed.sequence_parallel import sp_problem
    from digenrl.planner.shapes import model_shape

    shape = model_shape(cfg.model)
    problem = sp_problem(shape.transformer_class, shape.config, shape.tokens.x, shape.tokens.text, s)
    if problem:
        raise UserError(f"{head} {problem}")
