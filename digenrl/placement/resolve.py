"""``resolve(cfg) -> RunLayout``: the one place a run's layout is decided (docs/architecture.md).

Details: docs/modules.md, `digenrl.placement.resolve`.
"""

from __future__ import annotations

from dataclasses import replace

from digenrl.adapters.vae_decode import tiling_mode
from digenrl.config.run import RunConfig
from digenrl.distributed.settings import fsdp_refusal, node_refusal, sp_refusal
from digenrl.errors import UserError
from digenrl.placement.layout import RunLayout, engine_layout, local_layout
from digenrl.placement.plan import Plan
from digenrl.placement.preflight import (
    GiB,
    check_memory,
    known_gpu_type,
    memory_model,
    resolve_cfg_batching,
    resolve_memory_settings,
    resolve_rollout_batch,
)
from digenrl.placement.tag_choice import bts_priors, settle_tag
from digenrl.policy.settings import Settings, kl_reference


def resolve(cfg: RunConfig) -> RunLayout:
    """The run's layout (module docstring); raises UserError on a combination the engine refuses."""
    if cfg.placement.mode == "local":
        return local_layout(cfg)

    # the memory model, built once for every step below (only where a pool has a known GPU type: the
    # steps use it only there)
    model = memory_model(cfg) if any(known_gpu_type(p) for p in cfg.cluster.pools) else None
    cfg, tag_note = settle_tag(cfg, model)  # engine.tag unset: auto where TAG is allowed, else off
    plan = check_memory(cfg, model)  # (the plan it built: on devices of known memory)
    check_sp(cfg)
    plan = plan or Plan.from_run_config(cfg)  # the one plan of the run
    check_device(cfg, plan)
    memory = resolve_memory_settings(cfg, plan, model)
    fsdp = fsdp_degree(cfg, plan, memory.fsdp)
    ac = cfg.train.activation_checkpointing
    settings = Settings(
        fsdp=fsdp,
        activation_checkpointing=memory.activation_checkpointing if ac == "auto" else ac == "on",
        micro_batch=memory.micro_batch,
        rollout_batch=resolve_rollout_batch(cfg, plan, model),
        colocated_batch=colocated_batch(cfg, plan),
        cfg_batching_trainer=resolve_cfg_batching(cfg, True, plan, memory, model),
        cfg_batching_rollout=resolve_cfg_batching(cfg, False, plan, memory, model),
        vae_tiling=tiling_mode(cfg.model, cfg.sampling),
        weight_sync=weight_sync_mode(cfg, plan),
        weight_sync_fallback=cfg.engine.weight_sync == "auto" and plan.rollout_pool is not None,
        gpu_device="cpu" if cfg.train.device == "cpu" else "cuda",  # (auto on a GPU pool: its GPU)
        memory_device=memory.device,
        memory_need_gib=round(memory.need_bytes / GiB, 2),
        memory_have_gib=round(memory.have_bytes / GiB, 2),
        kl_reference=kl_reference(cfg, gpu=_gpu_pools(cfg, plan)),
    )
    try:
        scheduler = plan.scheduler_config(
            cfg.train.prompts_per_iteration,
            cfg.train.iterations,
            wait_for_full_batch=cfg.algorithm.std == "global",
            optimizer_steps=cfg.train.optimizer_steps,
        )
    except ValueError as exc:
        raise UserError(f"engine: {exc}") from None
    layout = engine_layout(cfg, plan, settings, scheduler)
    return replace(layout, tag_note=tag_note, bts_priors=bts_priors(cfg, plan))


def colocated_batch(cfg: RunConfig, plan: Plan) -> int | None:
    """``engine.colocated_batch`` as the workers that also train run it (colocated, TAG ranks): samples
    per sampling forward, or None for the train forwards' batches (``trainer``; no such worker;
    ``auto`` on a trainer pool of unknown memory). ``auto`` on known GPU types: the whole unit in one
    forward -- what the memory model already holds on such a device (``MemoryModel.trainer_need``)."""
    value = cfg.engine.colocated_batch
    if not (plan.placement == "colocated" or plan.tag) or value == "trainer":
        return None
    if isinstance(value, int):
        return value
    if not all(known_gpu_type(p) for p in plan.trainer_pools):
        return None
    return max(1, round(plan.unit_size * cfg.algorithm.group_size))


def _gpu_pools(cfg: RunConfig, plan: Plan) -> bool:
    """Whether every device of the run is a GPU its models run on (``engine``/``algorithm`` autos that
    pay off only there: ``algorithm.kl_reference``)."""
    return cfg.train.device != "cpu" and all(p.device.lower() != "cpu" for p in plan.pools)


def check_device(cfg: RunConfig, plan: Plan) -> None:
    """A CUDA run on logical CPU pools is refused here, before Ray."""
    if cfg.train.device == "cuda" and any(p.device.lower() == "cpu" for p in plan.pools):
        raise UserError(
            "train.device: cuda, but cluster.pools devices are 'cpu' (logical CPU pools); "
            "set the pools' device to 'gpu' or a GPU type such as H100"
        )


def weight_sync_mode(cfg: RunConfig, plan: Plan) -> str:
    """How trainer rank 0 ships versions: ``none`` without rollout workers, else ``engine.weight_sync``
    (``auto``: the broadcast group, with the object store as the fallback when it does not form)."""
    if plan.rollout_pool is None:
        return "none"
    return "object_store" if cfg.engine.weight_sync == "object_store" else "broadcast"


def fsdp_degree(cfg: RunConfig, plan: Plan, memory_degree: int) -> int:
    """``train.fsdp`` as the trainer ranks run it (``auto``: the memory model's ``memory_degree``),
    refused with one line where that sharding means nothing (:func:`fsdp_refusal`)."""
    n, head = cfg.train.fsdp, f"train.fsdp: {cfg.train.fsdp}:"
    if n == "auto":
        n, head = memory_degree, f"train.fsdp: auto (the memory preflight needs {memory_degree}):"
    if n in ("off", 1):
        return 1
    mode = cfg.placement.mode
    ranks = sum(w.role != "rollout" for w in plan.workers()) if mode != "local" else 0
    why = fsdp_refusal(n, placement=mode, ranks=ranks, trainer_sp=cfg.engine.trainer_sp)
    node = cfg.cluster.gpus_per_node
    if not why and node is not None:
        why = node_refusal(n, node, ranks, cfg.engine.trainer_sp)
    if why:
        raise UserError(f"{head} {why}")
    return n


def check_sp(cfg: RunConfig) -> None:
    """What sequence parallelism means something (:func:`sp_refusal`): ``engine.rollout_sp: s`` makes
    each s consecutive devices of a disaggregated rollout pool one rollout worker, ``engine.trainer_sp:
    s`` each s consecutive trainer devices one trainer rank. Anything else: one line."""
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
        why = sp_refusal(role, s, placement=mode, devices=devices[role], shape=shape)
        if why:
            raise UserError(f"engine.{key}: {s}: {why}")
