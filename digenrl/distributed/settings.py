"""How ``train.fsdp`` and ``train.activation_checkpointing`` resolve to what a trainer does.

``auto`` is meant to be chosen by the planner's memory model (per-device need vs capacity). Until
that model is wired into the runtime, ``auto`` resolves to no sharding and no activation
checkpointing -- what the tiny presets need.
"""

from __future__ import annotations

from digenrl.errors import UserError


def resolve_activation_checkpointing(train_cfg) -> bool:
    return train_cfg.activation_checkpointing == "on"


def resolve_fsdp(train_cfg, trainer_ranks: int) -> int:
    """The sharding degree: 1 = replicated (DDP-style bucketed all-reduce), N = FSDP2 over groups
    of N ranks (HSDP, replicated across the groups, when N < ``trainer_ranks``)."""
    value = train_cfg.fsdp
    if value in ("auto", "off"):
        return 1
    if trainer_ranks % value:
        raise UserError(f"train.fsdp: {value} does not divide the {trainer_ranks} trainer ranks")
    return value


def check_fsdp_wired(cfg) -> None:
    """What ``train.fsdp: N`` (N > 1) is wired for: the engine's disaggregated trainer group of
    exactly N ranks, training each unit together (every rank an equal slice of its samples, so
    every rank runs the same forward / backward passes). Anything else is refused."""
    n = cfg.train.fsdp
    if not (isinstance(n, int) and n > 1):
        return
    head = f"train.fsdp: {n}:"
    if cfg.placement.mode != "disaggregated":
        raise UserError(f"{head} sharded trainer ranks need placement.mode: disaggregated "
                        f"(got {cfg.placement.mode}); use train.fsdp: off")
    from digenrl.placement import engine_workers

    ranks = sum(w.role == "trainer" for w in engine_workers(cfg))
    if ranks != n:
        raise UserError(f"{head} must equal the number of trainer ranks ({ranks}); HSDP (a degree that divides "
                        "them) is not wired; use train.fsdp: off")
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
    if per_unit % n:
        what = ("engine.unit_samples" if e.unit_samples else "engine.unit_groups x algorithm.group_size "
                f"({e.unit_groups} x {group})")
        raise UserError(f"{head} {what}: {per_unit} samples per unit must split evenly over the {n} ranks")
