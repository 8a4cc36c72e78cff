"""Memory preflight: does the run's placement fit its devices, before anything starts?

One function for the runtime and the planner: :func:`resolve_memory_settings` turns
``train.fsdp: auto`` and ``train.activation_checkpointing: auto`` into what a trainer rank runs,
by the planner's memory model (:mod:`digenrl.planner.memory`); :func:`check_memory` refuses, with
one line, a placement that cannot fit and names the setting that would.

Which devices are checked: pools of a known GPU type (:data:`~digenrl.planner.gpus.DEVICES`).
Logical CPU pools (``device: cpu``) share the host's RAM with each other and the OS and have no
fixed per-device limit, and ``gpu`` / ``cuda`` pools name no type: both are skipped (the run
then finds out at allocation time).
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.errors import UserError

GiB = 2**30


@dataclass(frozen=True)
class MemorySettings:
    """What a trainer rank of the run does, and what it needs on its device."""

    fsdp: int  # 1 = replicated
    activation_checkpointing: bool
    micro_batch: int
    need_bytes: float = 0.0
    have_bytes: float = 0.0
    device: str = ""  # the trainer pool's device type ("" when not checked)


def _model(cfg):
    from digenrl.planner.costmodel import CostParams
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.workload import Workload

    return MemoryModel(Workload.from_config(cfg), CostParams())


def _known_type(pool) -> str | None:
    from digenrl.planner.gpus import DEVICES, device_spec

    if pool.device.lower() in ("cpu", "gpu", "cuda"):
        return None
    spec = device_spec(pool.device, f"cluster.pools.{pool.name}.device")
    return spec.name if DEVICES[spec.name].kind == "gpu" else None


def _plan(cfg):
    from digenrl.placement import Plan

    return Plan.from_run_config(cfg)


def _explicit(cfg) -> tuple:
    t = cfg.train
    fsdp = "off" if t.fsdp == 1 else t.fsdp
    return fsdp, t.activation_checkpointing


def resolve_memory_settings(cfg) -> MemorySettings:
    """``train.fsdp`` / ``train.activation_checkpointing`` of ``cfg`` as a trainer rank runs them:
    explicit values as written; ``auto`` as the first setting that fits the trainer device by the
    memory model, in its preference order (replicated, then the smallest FSDP degree dividing the
    trainer ranks, then the same with checkpointing). ``auto`` on a device with no known memory
    (CPU, untyped GPU) resolves to no sharding and no checkpointing; where nothing fits, to the
    last setting tried (the largest degree, checkpointing on), which :func:`check_memory` refuses."""
    t = cfg.train
    fsdp, ac = _explicit(cfg)
    plain = MemorySettings(1 if fsdp in ("auto", "off") else fsdp, ac == "on", t.micro_batch)
    if cfg.placement.mode == "local":
        return plain
    plan = _plan(cfg)
    devices = [d for d in (_known_type(p) for p in plan.trainer_pools) if d]
    if not devices:
        return plain
    model = _model(cfg)
    tag = plan.placement == "colocated" or plan.tag
    device = min(devices, key=model.have)  # the tightest trainer device decides
    fits, miss = model.setups(device, plan.ranks, tag, plan.unit_groups, fsdp=fsdp, checkpointing=ac,
                              micro_batch=t.micro_batch)
    s = fits[0] if fits else miss
    return MemorySettings(s.shard, s.checkpointing, s.micro_batch, s.need_bytes, s.have_bytes, device)


def _changes(s, cfg) -> list[tuple[str, object]]:
    """The ``train`` keys whose values in the config differ from fitting setup ``s``: an explicit
    value that differs, or ``auto`` where the setup shards / checkpoints (said explicitly)."""
    t, out = cfg.train, []
    fsdp = s.shard if s.shard > 1 else "off"
    if (t.fsdp == "auto" and s.shard > 1) or (t.fsdp != "auto" and (1 if t.fsdp == "off" else t.fsdp) != s.shard):
        out.append(("train.fsdp", fsdp))
    ac = "on" if s.checkpointing else "off"
    if (t.activation_checkpointing == "auto" and s.checkpointing) or t.activation_checkpointing not in ("auto", ac):
        out.append(("train.activation_checkpointing", ac))
    if s.micro_batch != t.micro_batch:
        out.append(("train.micro_batch", s.micro_batch))
    return out


def _where(pool, device: str, model) -> str:
    from digenrl.planner.gpus import DEVICES

    return (f"pool '{pool.name}' ({pool.count} x {device}, {DEVICES[device].memory / 1e9:.0f} GB, "
            f"{model.have(device) / GiB:.1f} GiB usable)")


def check_memory(cfg) -> None:
    """Refuse (UserError, one line) a placement whose per-device memory does not fit: the trainer
    ranks at the configured (or ``auto``-resolved) sharding, checkpointing and micro-batch, the
    rollout workers at ``engine.unit_groups`` groups per unit."""
    if cfg.placement.mode == "local":
        return
    plan = _plan(cfg)
    typed = [(p, _known_type(p)) for p in plan.pools]
    if not any(d for _, d in typed):
        return
    model = _model(cfg)
    tag = plan.placement == "colocated" or plan.tag
    fsdp, ac = _explicit(cfg)
    for pool, device in typed:
        if device is None:
            continue
        if plan.role(pool) == "rollout":
            _check_rollout(cfg, model, pool, device, plan.unit_groups)
            continue
        fits, miss = model.setups(device, plan.ranks, tag, plan.unit_groups, fsdp=fsdp, checkpointing=ac,
                                  micro_batch=cfg.train.micro_batch)
        if fits:
            continue
        other, _ = model.setups(device, plan.ranks, tag, plan.unit_groups)
        changes = _changes(other[0], cfg) if other else []
        if changes:  # the error names the first key to change
            key = changes[0][0]
            fix = (f"set {', '.join(f'{k}: {v}' for k, v in changes)} "
                   f"(needs {other[0].need_bytes / GiB:.1f} GiB)")
        else:
            key = f"cluster.pools.{pool.name}"
            fix = (f"no setting fits {plan.ranks} trainer ranks of this type (FSDP up to {plan.ranks}, activation "
                   "checkpointing, micro-batch 1): use more or larger trainer devices")
        raise UserError(f"{key}: {_where(pool, device, model)}: a trainer rank needs "
                        f"{miss.need_bytes / GiB:.1f} GiB at {_described(miss)}; {fix}")


def _described(s) -> str:
    return (f"train.fsdp {s.shard if s.shard > 1 else 'off'}, activation checkpointing "
            f"{'on' if s.checkpointing else 'off'}, micro-batch {s.micro_batch}")


def _check_rollout(cfg, model, pool, device: str, groups: int) -> None:
    s = model.rollout(device, groups)
    if s.fits:
        return
    prompts = cfg.train.prompts_per_iteration  # a unit size divides the prompts into whole units
    smaller = [g for g in range(groups - 1, 0, -1) if prompts % g == 0 and model.rollout(device, g).fits]
    fix = (f"set engine.unit_groups: {smaller[0]} (fewer samples per unit)" if smaller else
           "even a unit of 1 group does not fit: use a larger rollout device")
    raise UserError(f"engine.unit_groups: {_where(pool, device, model)}: a rollout worker needs "
                    f"{s.need_bytes / GiB:.1f} GiB for units of {groups} groups; {fix}")
