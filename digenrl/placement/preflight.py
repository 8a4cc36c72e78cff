"""What ``digenrl train`` would reject, checked in seconds and without training: the preflight that
``digenrl config validate`` runs, built from the checks the drivers themselves make (no second copy).

Details: docs/modules.md, `digenrl.placement.preflight`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from digenrl.adapters import adapter_class
from digenrl.config.run import RunConfig
from digenrl.errors import UserError, relative_note
from digenrl.placement.devices import DEVICES, device_spec
from digenrl.placement.plan import Plan
from digenrl.planner.params import CostParams

#: logical CPU devices (one worker process each) a host may run per core: the engine's own tests
#: run 3 workers on 2 cores; 16 on 2 cores only crawl
CPU_DEVICES_PER_CORE = 2


def check_resources(cfg: RunConfig, ray_address: str | None = None) -> None:
    """The pools against this host (skipped for a local placement and for an existing Ray cluster)."""
    if cfg.placement.mode == "local" or ray_address is not None:
        return
    cores = os.cpu_count() or 1
    cpu = sum(p.count for p in cfg.cluster.pools if p.device.lower() == "cpu")
    if cpu > CPU_DEVICES_PER_CORE * cores:
        raise UserError(
            f"cluster.pools: {cpu} logical CPU devices on a host with {cores} cores (at most "
            f"{CPU_DEVICES_PER_CORE * cores}: each is a worker process); use fewer, or join a larger "
            "cluster with --ray-address"
        )
    gpu = sum(p.count for p in cfg.cluster.pools if p.device.lower() != "cpu")
    if gpu:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpu > visible:
            raise UserError(
                f"cluster.pools: {gpu} GPU devices, but this host has {visible} visible GPUs; "
                "join a GPU cluster with --ray-address or change the pools"
            )


def check_config(cfg: RunConfig, layout, ray_address: str | None = None) -> list[str]:
    """Everything train would reject beyond the run's ``layout`` (:func:`digenrl.placement.resolve.resolve`
    already refused what does not fit or does not run), in the order train meets it; returns what
    was checked."""
    checked = []
    check_resources(cfg, ray_address)
    if cfg.placement.mode != "local":
        pools = ", ".join(f"{p.count}x {p.device}" for p in cfg.cluster.pools)
        checked.append(f"placement {cfg.placement.mode} on {pools}")
    check_model(cfg)
    checked.append(
        f"model {cfg.model.adapter} ({cfg.model.preset or cfg.model.pretrained}) "
        f"{cfg.model.height}x{cfg.model.width}" + (f"x{cfg.model.frames}" if cfg.model.frames else "")
    )
    check_workers_build(cfg, layout)  # prompts, reward, and (tiny preset) the model with its LoRA targets
    checked.append(f"prompts, reward ({', '.join(t.name for t in cfg.reward.components)})")
    return checked


def check_model(cfg: RunConfig) -> None:
    """Shapes, preset / checkpoint directory and LoRA targets, without loading any weights."""

    cls = adapter_class(cfg.model.adapter)
    probe = cls.__new__(cls)  # only the config: check_shapes reads nothing else
    probe.cfg, probe.sampling = cfg.model, cfg.sampling
    probe.check_shapes()
    if cfg.model.pretrained is None:
        return  # the tiny preset is built (cheaply, for real) by the engine's preflight
    root = Path(cfg.model.pretrained)
    if not root.is_dir():
        raise UserError(f"model.pretrained: checkpoint directory not found: {root}{relative_note(root)}")
    if not (root / "model_index.json").is_file():
        raise UserError(f"model.pretrained: {root} is not a diffusers checkpoint (no model_index.json)")
    if (root / "transformer" / "config.json").is_file() and cfg.model.lora is not None:
        from digenrl.planner.shapes import model_shape, param_counts

        param_counts(model_shape(cfg.model), cfg.model.lora, cls.default_lora_targets)  # on the meta device


# ------------------------------------------------------------------ memory

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
    cfg_batched: bool = False  # two-pass CFG as one forward of 2B (auto on an unchecked device: sequential)


def memory_model(cfg):
    """The memory model of ``cfg`` (its Workload and the default CostParams). `resolve.resolve`
    builds it once per layout and hands it to every function below (``model=``); each builds its own
    when called alone."""
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.workload import Workload

    return MemoryModel(Workload.from_config(cfg), CostParams())


def known_gpu_type(pool) -> str | None:
    if pool.device.lower() in ("cpu", "gpu", "cuda"):
        return None
    spec = device_spec(pool.device, f"cluster.pools.{pool.name}.device")
    return spec.name if DEVICES[spec.name].kind == "gpu" else None


def _plan(cfg):
    return Plan.from_run_config(cfg)


def _explicit(cfg) -> tuple:
    t = cfg.train
    fsdp = "off" if t.fsdp == 1 else t.fsdp
    return fsdp, t.activation_checkpointing


def resolve_memory_settings(cfg, plan=None, model=None) -> MemorySettings:
    """``train.fsdp`` / ``train.activation_checkpointing`` of ``cfg`` as a trainer rank runs them:
    explicit values as written; ``auto`` as the first setting that fits the trainer device by the
    memory model, in its preference order (replicated, then the smallest FSDP degree dividing the
    trainer ranks, then the same with checkpointing). ``auto`` on a device with no known memory
    (CPU, untyped GPU) resolves to no sharding and no checkpointing; where nothing fits, to the
    last setting tried (the largest degree, checkpointing on), which :func:`check_memory` refuses."""
    t = cfg.train
    fsdp, ac = _explicit(cfg)
    plain = MemorySettings(
        1 if fsdp in ("auto", "off") else fsdp,
        ac == "on",
        t.micro_batch,
        cfg_batched=cfg.sampling.cfg_batching == "batched",
    )
    if cfg.placement.mode == "local":
        return plain
    plan = plan or _plan(cfg)
    devices = [d for d in (known_gpu_type(p) for p in plan.trainer_pools) if d]
    if not devices:
        return plain
    model = model or memory_model(cfg)
    tag = plan.placement == "colocated" or plan.tag
    device = min(devices, key=model.have)  # the tightest trainer device decides
    fits, miss = model.setups(
        device,
        plan.ranks,
        tag,
        plan.unit_size,
        plan.trainer_sp,
        fsdp=fsdp,
        checkpointing=ac,
        micro_batch=t.micro_batch,
        cfg=cfg.sampling.cfg_batching,
    )
    s = fits[0] if fits else miss
    return MemorySettings(
        s.shard, s.checkpointing, s.micro_batch, s.need_bytes, s.have_bytes, device, s.cfg_batched
    )


def resolve_cfg_batching(
    cfg, trainable: bool, plan=None, memory: MemorySettings | None = None, model=None
) -> str:
    """``sampling.cfg_batching`` as a worker runs it (``batched`` | ``sequential``): explicit values as
    written; ``auto`` as the memory model resolves it for the worker's role -- a trainer rank (``trainable``;
    colocated devices and TAG ranks too) by :func:`resolve_memory_settings`, a rollout worker by its unit's
    fit -- and ``sequential`` (the families' own pipelines' way, the least memory) where the device's
    memory is unknown (local runs, CPU pools, untyped GPUs)."""
    value = cfg.sampling.cfg_batching
    if value != "auto" or cfg.placement.mode == "local":
        return "sequential" if value == "auto" else value
    plan = plan or _plan(cfg)
    if trainable:
        s = memory or resolve_memory_settings(cfg, plan, model)
        return "batched" if s.device and s.cfg_batched else "sequential"
    device = known_gpu_type(plan.rollout_pool) if plan.rollout_pool is not None else None
    if device is None:
        return "sequential"
    s = (model or memory_model(cfg)).rollout(device, plan.unit_size, plan.rollout_sp)
    return "batched" if s.fits and s.cfg_batched else "sequential"


def _changes(s, cfg) -> list[tuple[str, object]]:
    """The ``train`` keys whose values in the config differ from fitting setup ``s``: an explicit
    value that differs, or ``auto`` where the setup shards / checkpoints (said explicitly)."""
    t, out = cfg.train, []
    fsdp = s.shard if s.shard > 1 else "off"
    if (t.fsdp == "auto" and s.shard > 1) or (
        t.fsdp != "auto" and (1 if t.fsdp == "off" else t.fsdp) != s.shard
    ):
        out.append(("train.fsdp", fsdp))
    ac = "on" if s.checkpointing else "off"
    if (t.activation_checkpointing == "auto" and s.checkpointing) or t.activation_checkpointing not in (
        "auto",
        ac,
    ):
        out.append(("train.activation_checkpointing", ac))
    if cfg.sampling.cfg_batching == "batched" and not s.cfg_batched:
        out.append(("sampling.cfg_batching", "sequential"))
    if s.micro_batch != t.micro_batch:
        out.append(("train.micro_batch", s.micro_batch))
    return out


def _where(pool, device: str, model) -> str:
    return (
        f"pool '{pool.name}' ({pool.count} x {device}, {DEVICES[device].memory / 1e9:.0f} GB, "
        f"{model.have(device) / GiB:.1f} GiB usable)"
    )


def check_memory(cfg, model=None):
    """Refuse (UserError, one line) a placement whose per-device memory does not fit: the trainer
    ranks at the configured (or ``auto``-resolved) sharding, checkpointing and micro-batch, the
    rollout workers at ``engine.unit_groups`` groups per unit. Returns the plan it checked (None
    when there was nothing to check: a local run, or no pool of a known GPU type)."""
    if cfg.placement.mode == "local" or not any(known_gpu_type(p) for p in cfg.cluster.pools):
        return None  # nothing to check against (logical CPU / untyped GPU pools): no plan built yet
    plan = _plan(cfg)
    typed = [(p, known_gpu_type(p)) for p in plan.pools]
    if not any(d for _, d in typed):
        return plan
    model = model or memory_model(cfg)
    tag = plan.placement == "colocated" or plan.tag
    fsdp, ac = _explicit(cfg)
    for pool, device in typed:
        if device is None:
            continue
        if plan.role(pool) == "rollout":
            _check_rollout(cfg, model, plan, pool, device)
            continue
        fits, miss = model.setups(
            device,
            plan.ranks,
            tag,
            plan.unit_size,
            plan.trainer_sp,
            fsdp=fsdp,
            checkpointing=ac,
            micro_batch=cfg.train.micro_batch,
            cfg=cfg.sampling.cfg_batching,
        )
        if fits:
            continue
        other, _ = model.setups(device, plan.ranks, tag, plan.unit_size, plan.trainer_sp)
        changes = _changes(other[0], cfg) if other else []
        if changes:  # the error names the first key to change
            key = changes[0][0]
            fix = (
                f"set {', '.join(f'{k}: {v}' for k, v in changes)} "
                f"(needs {other[0].need_bytes / GiB:.1f} GiB)"
            )
        else:
            key = f"cluster.pools.{pool.name}"
            fix = (
                f"no setting fits {plan.ranks} trainer ranks of this type (FSDP up to "
                f"{plan.ranks * plan.trainer_sp}, activation checkpointing, sequential CFG, micro-batch 1): "
                "use more or larger trainer devices"
                + ("" if plan.trainer_sp > 1 or not model.workload.video else ", or engine.trainer_sp > 1")
            )
        raise UserError(
            f"{key}: {_where(pool, device, model)}: a trainer rank needs "
            f"{miss.need_bytes / GiB:.1f} GiB at {_described(miss)}; {fix}"
        )
    return plan


def _described(s) -> str:
    return (
        f"train.fsdp {s.shard if s.shard > 1 else 'off'}, activation checkpointing "
        f"{'on' if s.checkpointing else 'off'}, micro-batch {s.micro_batch}"
        + (f", {'batched' if s.cfg_batched else 'sequential'} CFG" if s.parts.get("activations") else "")
        + (f", SP x{s.sp}" if s.sp > 1 else "")
    )


def resolve_rollout_batch(cfg, plan=None, model=None) -> int | None:
    """``engine.rollout_batch`` as a rollout-only worker runs it: samples per sampling forward, or None
    for the train forwards' batches (``trainer``; no rollout-only worker; ``auto`` on a rollout device
    of unknown memory -- CPU pools, untyped GPUs). ``auto`` on a known GPU type: the largest batch
    (at most a unit) with which the memory model holds a unit there."""
    value = cfg.engine.rollout_batch
    if cfg.placement.mode != "disaggregated" or value == "trainer":
        return None
    if isinstance(value, int):
        return value
    plan = plan or _plan(cfg)
    device = known_gpu_type(plan.rollout_pool)
    if device is None:
        return None
    model = model or memory_model(cfg)
    return model.rollout_batch(device, plan.unit_size, plan.rollout_sp, cfg.sampling.cfg_batching)


def _check_rollout(cfg, model, plan, pool, device: str) -> None:
    groups, sp, mode = plan.unit_groups, plan.rollout_sp, cfg.sampling.cfg_batching
    batch = resolve_rollout_batch(cfg, plan, model)
    s = model.rollout(device, plan.unit_size, sp, mode, batch)
    if s.fits:
        return
    if mode == "batched" and model.rollout(device, plan.unit_size, sp, "sequential", batch).fits:
        fix = "set sampling.cfg_batching: sequential (or auto)"
        key = "sampling.cfg_batching"
    else:
        prompts = cfg.train.prompts_per_iteration  # a unit size divides the prompts into whole units
        smaller = [
            g
            for g in range(groups - 1, 0, -1)
            if prompts % g == 0 and model.rollout(device, g, sp, mode, batch).fits
        ]
        fix = (
            f"set engine.unit_groups: {smaller[0]} (fewer samples per unit)"
            if smaller
            else "even a unit of 1 group does not fit: use a larger rollout device"
            + (", or engine.rollout_sp > 1" if model.workload.video and sp == 1 else "")
        )
        key = "engine.unit_groups"
    what = f"units of {groups} groups" if plan.group_parts == 1 else f"units of 1/{plan.group_parts} group"
    raise UserError(
        f"{key}: {_where(pool, device, model)}: a rollout worker needs "
        f"{s.need_bytes / GiB:.1f} GiB per device for {what}"
        + (f" (SP x{sp})" if sp > 1 else "")
        + f"; {fix}"
    )


def check_workers_build(cfg: RunConfig, layout, resumed=None) -> None:
    """Validate here, in seconds and before Ray starts, what every worker will build: prompts, the
    reward (dry-run on a decoded sample) and -- for a random-init preset, which is cheap to build
    -- the model, its LoRA targets and the fit of a checkpoint to resume. A pretrained model is
    only built by the workers (its errors reach the caller from there, as the same one line)."""
    from digenrl.data.prompts import load_prompts

    prompts = load_prompts(cfg.prompts)
    reward = check_rewards(cfg)
    if cfg.model.pretrained is None:
        from digenrl.checkpoint.load import load_checkpoint
        from digenrl.policy.model import Policy
        from digenrl.units.rollout import preflight_reward

        policy = Policy(cfg, device="cpu", trainable=resumed is not None, layout=layout)
        preflight_reward(reward, policy.adapter, prompts)
        if resumed is not None:  # fits this model, every file reads back (weights verified)
            load_checkpoint(resumed.path, policy, rng=False)


def check_rewards(cfg: RunConfig):
    """Every reward component built as the workers build it -- names, ``args``, the files a model reward
    reads -- except that no model is loaded: the driver never loads one on a device (``device: auto``
    would put it on the head's GPU and keep a CUDA context there all run); a model reward's checkpoint
    contents are checked by the process that loads it. Returns the rewards (models as stand-ins)."""
    from digenrl.rewards import build_reward

    return build_reward(cfg.reward, load_models=False)
