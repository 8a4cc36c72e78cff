"""Placement: which devices exist, which of them roll out and which train -- derived once.

Details: docs/modules.md, `digenrl.placement.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from digenrl.config.engine import PoolConfig
from digenrl.config.run import RunConfig, validate_config
from digenrl.errors import UserError
from digenrl.placement.devices import device_spec, known_devices
from digenrl.schedule.knobs import (
    EngineKnobs,
    SchedulingKnobs,
    engine_config_values,
    from_engine_config,
    knob_values,
)
from digenrl.schedule.scheduler import SchedulerConfig
from digenrl.units.types import Role, WorkerSpec

PLACEMENTS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Worker(WorkerSpec):
    """One engine worker: the scheduler's view (name, role) plus the pool its device belongs to."""

    pool: PoolConfig


@dataclass(frozen=True, kw_only=True)
class Plan(EngineKnobs):
    """A placement plus the engine knobs (:class:`~digenrl.schedule.knobs.EngineKnobs`); keyword
    arguments only. ``pools``: colocated, the pools whose devices do both jobs; disaggregated,
    ``(rollout pool, trainer pool)``."""

    placement: str  # "colocated" | "disaggregated"
    pools: tuple[PoolConfig, ...]
    micro_batch: int | None = None  # None: the config's
    pair_batch: int | None = None  # train.pair_batch: rows per timestep-pair forward (None: per step)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "disaggregated" and (
            len(self.pools) != 2 or self.pools[0].name == self.pools[1].name
        ):
            raise ValueError("a disaggregated plan has two pools of different names: (rollout, trainer)")
        if self.group_parts > 1 and self.unit_groups != 1:
            raise ValueError("a plan of sub-group units (group_parts > 1) has unit_groups 1")
        if self.placement == "colocated" and self.rollout_sp != self.trainer_sp:
            raise ValueError("a colocated plan's devices both roll out and train: rollout_sp == trainer_sp")
        for p in self.pools:
            if p.count % self.sp(p):
                raise ValueError(
                    f"pool '{p.name}': {p.count} devices do not split into workers of {self.sp(p)}"
                )

    @property
    def unit_size(self) -> float:
        """Prompt groups per rollout unit (a fraction for sub-group units)."""
        return self.unit_groups / self.group_parts

    # -- roles and workers ---------------------------------------------------------------

    def role(self, pool: PoolConfig) -> Role:
        if self.placement == "colocated":
            return "both"
        return "rollout" if pool.name == self.pools[0].name else "trainer"

    @property
    def rollout_pool(self) -> PoolConfig | None:
        return self.pools[0] if self.placement == "disaggregated" else None

    @property
    def trainer_pools(self) -> list[PoolConfig]:
        return list(self.pools[1:]) if self.placement == "disaggregated" else list(self.pools)

    def sp(self, pool: PoolConfig) -> int:
        """Devices per worker of ``pool`` (sequence parallelism)."""
        return self.rollout_sp if self.role(pool) == "rollout" else self.trainer_sp

    def worker_count(self, pool: PoolConfig) -> int:
        """Workers (rollout workers / trainer ranks) the pool's devices make: one per ``sp`` devices."""
        return pool.count // self.sp(pool)

    @property
    def ranks(self) -> int:
        """Trainer ranks: every device that trains, ``trainer_sp`` devices to a rank."""
        return sum(self.worker_count(p) for p in self.trainer_pools)

    def workers(self) -> list[Worker]:
        """One worker per device, rollout workers first (the order idle workers ask in)."""
        return [Worker(f"{p.name}{i}", self.role(p), p) for p in self.pools for i in range(p.count)]

    def leads(self) -> list[Worker]:
        """The workers the scheduler hands units to: with sequence parallelism the first device of
        each group of ``sp`` (the others run its calls with it); without, every device."""
        return [
            Worker(f"{p.name}{i}", self.role(p), p) for p in self.pools for i in range(0, p.count, self.sp(p))
        ]

    def scheduler_config(
        self,
        groups_per_iteration: int,
        iterations: int,
        wait_for_full_batch: bool = False,
        start_iteration: int = 0,
        optimizer_steps: int = 1,
    ) -> SchedulerConfig:
        """The scheduler's configuration for this plan and the run's work (``groups_per_iteration``,
        ``iterations``, ``optimizer_steps``: the algorithm's, not a placement choice)."""
        return SchedulerConfig(
            **knob_values(self, SchedulingKnobs),
            placement=self.placement,
            groups_per_iteration=groups_per_iteration,
            iterations=iterations,
            wait_for_full_batch=wait_for_full_batch,
            start_iteration=start_iteration,
            optimizer_steps=optimizer_steps,
        )

    # -- labels ----------------------------------------------------------------------------

    def where(self) -> str:
        """The hardware: 'colocated 16xH800' or 'R 4xH20 / T 8xH800'."""
        if self.placement == "colocated":
            per_type: dict[str, int] = {}
            for p in self.pools:
                per_type[p.device] = per_type.get(p.device, 0) + p.count
            return "colocated " + "+".join(f"{n}x{d}" for d, n in per_type.items())
        r, t = self.pools
        return f"R {r.count}x{r.device} / T {t.count}x{t.device}"

    def knobs(self) -> str:
        k = [f"m=1/{self.group_parts}" if self.group_parts > 1 else f"m={self.unit_groups}"]
        if self.placement == "disaggregated":
            k.append("GAP" if self.gap else "no GAP")
        if self.tsp_degree > 1:
            k.append(f"TSP{self.tsp_degree}")
        if self.rollout_sp > 1 or self.trainer_sp > 1:
            k.append(
                f"SP{self.rollout_sp}"
                if self.placement == "colocated" or self.rollout_sp == self.trainer_sp
                else f"SP{self.rollout_sp}/{self.trainer_sp}"
            )
        if self.pair_batch:
            k.append(f"pairs{self.pair_batch}")
        if self.placement == "disaggregated":
            if self.tag:
                k.append("TAG auto" if self.tag == "auto" else "TAG")
            if self.max_staleness:
                k.append("async")
        return " ".join(k)

    def label(self) -> str:
        return f"{self.where()} ({self.knobs()})"

    # -- run config <-> plan ---------------------------------------------------------------

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> Plan:
        """The plan a run config describes (devices as written; :func:`typed` names their types)."""
        mode, pools = cfg.placement.mode, {p.name: p for p in cfg.cluster.pools}
        e = cfg.engine
        if mode == "local":
            raise UserError("placement.mode: 'local' runs in one process, without the engine's placement")
        if mode == "colocated":
            chosen = tuple(cfg.cluster.pools)
        else:
            rollout, trainer = pools[cfg.placement.rollout_pool], pools[cfg.placement.trainer_pool]
            if rollout is trainer:
                raise UserError(
                    "placement: disaggregated needs placement.rollout_pool and placement.trainer_pool "
                    f"to be different pools (both are '{rollout.name}')"
                )
            chosen = (rollout, trainer)
        knobs = from_engine_config(e, cfg.algorithm.group_size)
        G, m, parts = cfg.algorithm.group_size, knobs["unit_groups"], knobs["group_parts"]
        if mode == "colocated" and e.unit_samples is None:
            m, parts = spread_units(
                cfg.train.prompts_per_iteration, m, G, sum(p.count for p in chosen) // e.trainer_sp
            )
        if mode == "colocated" and e.rollout_sp not in (1, e.trainer_sp):
            raise UserError(
                f"engine.rollout_sp: {e.rollout_sp}: a colocated worker rolls out and trains on the same "
                f"devices; set it to engine.trainer_sp ({e.trainer_sp}) or leave it at 1"
            )
        rollout_sp = e.trainer_sp if mode == "colocated" else e.rollout_sp  # colocated: one sp per device
        for i, p in enumerate(chosen):
            key, sp = (
                ("rollout_sp", rollout_sp)
                if mode == "disaggregated" and i == 0
                else ("trainer_sp", e.trainer_sp)
            )
            if p.count % sp:
                raise UserError(
                    f"engine.{key}: {sp} does not divide pool '{p.name}' ({p.count} x {p.device}): a worker "
                    f"spans {sp} devices"
                )
        return cls(
            **{**knobs, "unit_groups": m, "group_parts": parts, "rollout_sp": rollout_sp},
            placement=mode,
            pools=chosen,
            micro_batch=cfg.train.micro_batch,
            pair_batch=cfg.train.pair_batch,
        )

    def typed(self) -> Plan:
        """This plan with every pool's device as a known type's canonical name (what the cost model
        looks up); a pool of 'gpu' / 'cuda' (any GPU) cannot be simulated."""
        return replace(self, pools=tuple(p.model_copy(update={"device": device_type(p)}) for p in self.pools))


def spread_units(groups: int, unit_groups: int, group_size: int, devices: int) -> tuple[int, int]:
    """(unit_groups, group_parts) that give each of ``devices`` devices a rollout unit when the
    configured ``unit_groups`` would leave some idle: smaller units of whole groups while there are
    enough groups, else parts of groups (the fewest parts, a divisor of ``group_size``, that cover
    every device; at most one sample per unit). Unchanged when the units already cover the devices."""
    if groups // unit_groups >= devices:
        return unit_groups, 1
    if groups >= devices:
        return max(m for m in range(1, unit_groups + 1) if groups % m == 0 and groups // m >= devices), 1
    parts = next(
        (d for d in range(1, group_size + 1) if group_size % d == 0 and groups * d >= devices), group_size
    )
    return 1, parts


def device_type(pool: PoolConfig) -> str:
    """The canonical device type of ``pool`` (a :data:`~digenrl.placement.devices.DEVICES` key). 'gpu' and
    'cuda' mean "any GPU" to the runtime but name no type, so nothing can be predicted for them."""
    if pool.device.lower() in ("gpu", "cuda"):
        raise UserError(
            f"cluster.pools: pool '{pool.name}' has device '{pool.device}', which names no GPU type; "
            f"give a type (known: {', '.join(known_devices())}) or pass --cluster FILE"
        )
    return device_spec(pool.device, f"cluster.pools.{pool.name}.device").name


def apply_plan(cfg: RunConfig, plan: Plan, device: str) -> RunConfig:
    """``cfg`` with ``plan``'s cluster, placement and engine sections, its micro-batch (when it sets
    one), its ``train.pair_batch`` (None: per-step forwards) and ``train.device`` (``cpu`` or
    ``cuda``): the config ``plan --write`` writes."""

    data = cfg.model_dump(mode="json")
    data["cluster"] = {"pools": [p.model_dump(mode="json") for p in plan.pools]}
    data["placement"] = {
        "mode": plan.placement,
        "rollout_pool": plan.pools[0].name,
        "trainer_pool": plan.pools[-1].name,
    }
    data["engine"] = {**data["engine"], **engine_config_values(plan, cfg.algorithm.group_size)}
    if plan.micro_batch is not None:
        data["train"] = {**data["train"], "micro_batch": plan.micro_batch}
    data["train"] = {**data["train"], "device": device, "pair_batch": plan.pair_batch}
    return validate_config(data)
