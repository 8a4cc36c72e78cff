"""``engine.tag`` unset (the default) settled, and elastic TAG's priors: TAG auto (BTS) where the
memory model knows a trainer rank holds a rollout unit beside its training state at the settings it
trains with, off elsewhere; BTS's first unit times from the planner's cost model, so a run's first
decisions are predicted, not guessed (docs/architecture.md, "Elastic TAG (BTS)")."""

from __future__ import annotations

from digenrl.config.run import RunConfig
from digenrl.placement.plan import Plan
from digenrl.placement.preflight import _explicit, known_gpu_type
from digenrl.planner.gpus import cluster_from_run_config

Priors = tuple[tuple[str, str, float], ...]  # (kind, worker, seconds)


def with_tag(cfg: RunConfig, tag) -> RunConfig:
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"tag": tag})})


def settle_tag(cfg: RunConfig, model) -> tuple[RunConfig, str]:
    """(``cfg`` with ``engine.tag`` a value, the line that says why); an explicit value as written."""
    if cfg.engine.tag is not None:
        return cfg, ""
    tag, why = default_tag(cfg, model)
    return with_tag(cfg, tag), why


def default_tag(cfg: RunConfig, model) -> tuple[bool | str, str]:
    """``engine.tag`` unset: ``auto`` on a disaggregated run whose every trainer device is of a known
    GPU type and holds a rollout unit beside its training state at the setup (sharding,
    checkpointing, micro-batch, CFG batching) it would train with without TAG; else off."""
    if cfg.placement.mode != "disaggregated":
        return False, ""  # colocated devices roll out anyway; local runs have one process
    plan = Plan.from_run_config(cfg)
    head = "engine.tag unset: TAG"
    devices = [known_gpu_type(p) for p in plan.trainer_pools]
    if model is None or not all(devices):
        return False, f"{head} off (trainer memory unknown on CPU pools and untyped GPUs; set auto for BTS)"
    fsdp, ac = _explicit(cfg)
    kw = dict(fsdp=fsdp, checkpointing=ac, micro_batch=cfg.train.micro_batch, cfg=cfg.sampling.cfg_batching)
    for device in dict.fromkeys(devices):
        plain, _ = model.setups(device, plan.ranks, False, plan.unit_size, plan.trainer_sp, **kw)
        tagged, miss = model.setups(device, plan.ranks, True, plan.unit_size, plan.trainer_sp, **kw)
        if not plain:
            return False, ""  # the trainer does not fit at all: check_memory says so
        if not tagged:
            return False, f"{head} off (a rollout unit does not fit beside a trainer rank on {device})"
        if _setup(tagged[0]) != _setup(plain[0]):
            change = _changed(_setup(plain[0]), _setup(tagged[0]))
            return False, f"{head} off (a TAG trainer rank on {device} would need {change})"
    return "auto", f"{head} auto (a trainer rank holds a rollout unit beside its training state)"


def _setup(s) -> tuple:
    cfg = "batched" if s.cfg_batched else "sequential"
    return (s.shard, "on" if s.checkpointing else "off", s.micro_batch, cfg)


def _changed(plain: tuple, tagged: tuple) -> str:
    """What TAG's setup changes, e.g. "FSDP x2 (not FSDP x1)"."""
    names = ("FSDP x{}", "checkpointing {}", "micro-batch {}", "CFG {}")
    return ", ".join(f"{n.format(b)} (not {n.format(a)})" for n, a, b in zip(names, plain, tagged) if a != b)


def bts_priors(cfg: RunConfig, plan: Plan) -> Priors:
    """The unit times BTS starts from on a ``tag: auto`` run over known GPU types: the planner's cost
    model as its simulator pays them (:func:`digenrl.planner.sim_bts.priors`); none elsewhere (the
    run measures its own; until then TAG is taken, as with ``tag: on``)."""
    if plan.tag != "auto" or plan.placement != "disaggregated":
        return ()
    if not all(known_gpu_type(p) for p in plan.pools):
        return ()
    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.sim_bts import priors
    from digenrl.planner.simulator import Simulator
    from digenrl.planner.workload import Workload

    cost = CostModel(Workload.from_config(cfg), cluster_from_run_config(cfg))
    sim = Simulator(plan, cost, iterations=1, wait_for_full_batch=cfg.algorithm.std == "global")
    return tuple(sorted((k, w, float(s)) for (k, w), s in priors(sim, sim.sched.cfg).items()))
