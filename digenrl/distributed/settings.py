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


def check_fsdp_wired(train_cfg) -> None:
    """FSDP2 sharding exists as components (:mod:`digenrl.distributed.fsdp`) but the engine does
    not build sharded trainer ranks yet: refuse a sharding degree rather than silently train
    replicated."""
    if isinstance(train_cfg.fsdp, int) and train_cfg.fsdp > 1:
        raise UserError(f"train.fsdp: {train_cfg.fsdp}: sharded trainer ranks are not wired into the engine yet; "
                        "use train.fsdp: off (or auto)")
