"""The placement, cluster, fault and engine sections (docs/engine.md)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from digenrl.config.base import (
    MAX_BATCH,
    MAX_STEPS,
    _Section,
    on_off,
)


# ----------------------------------------------------------------------- cluster / placement / engine
class PoolConfig(_Section):
    """A pool of devices of one type: the one pool type of run configs, cluster files and plans
    (:mod:`digenrl.placement.plan`). Frozen: plans hash it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="1-64 letters, digits, _ . - (it names Ray resources and timeline rows)")
    device: str = Field("cpu", description="device type: cpu (logical) or a GPU name such as H800, H20, A100")
    count: int = Field(1, gt=0)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise ValueError(f"a pool name is 1-64 letters, digits, '_', '.' or '-' (got {shown!r})")
        return name


class ClusterConfig(_Section):
    pools: list[PoolConfig] = Field(
        default_factory=lambda: [
            PoolConfig(name="rollout", device="cpu"),
            PoolConfig(name="trainer", device="cpu"),
        ],
        min_length=1,
    )
    gpus_per_node: int | None = Field(
        None,
        gt=0,
        description=(
            "GPUs per node (`digenrl plan` writes its cluster's): a shard group wider than a node is "
            "refused before the run (null: checked when the run reserves its devices)"
        ),
    )


class PlacementConfig(_Section):
    mode: Literal["local", "colocated", "disaggregated"] = Field(
        "colocated", description="local = one process, no Ray; colocated / disaggregated = the engine"
    )
    rollout_pool: str = "rollout"
    trainer_pool: str = "trainer"


class FaultConfig(_Section):
    worker: str = Field(description="worker name, e.g. rollout0 (pool name + index) or reward")
    unit: str = Field(
        description=(
            "unit uid, e.g. rollout-2-0 (iteration 2, unit 0) or train-1-0-0: the process dies after the "
            "unit's work; <uid>:start on a sequence-parallel or sharded group's follower: as its share "
            "starts, while its lead waits in the unit's collectives; a :block or :stop suffix: blocks "
            "its main thread (still answering pings) or SIGSTOPs the process instead; sync-<version> on "
            "trainer rank 0 corrupts that version's broadcast weight sync in transit instead"
        )
    )


class EngineConfig(_Section):
    unit_groups: int = Field(1, gt=0, description="GAP unit size: prompt groups per rollout unit")
    unit_samples: int | None = Field(
        None,
        gt=0,
        description=(
            "sub-group units: samples per rollout unit, a divisor of algorithm.group_size (a unit holds part "
            "of one group; the group trains once all its parts are scored). Unset: engine.unit_groups whole "
            "groups per unit, except colocated, where groups are split automatically when they are fewer "
            "than the devices"
        ),
    )
    gap: bool = Field(
        False, description="GAP (disaggregated): train each rollout unit as soon as it is scored"
    )
    tsp_degree: int = Field(
        1, gt=0, le=MAX_STEPS, description="TSP: trained timesteps split over this many ranks"
    )
    tag: bool | Literal["auto"] | None = Field(
        None,
        description=(
            "TAG (disaggregated): an idle trainer rank rolls out a pending unit -- on (whenever it can), "
            "off, or auto (only where BTS predicts the iteration ends sooner with it; docs/architecture.md). "
            "Unset: auto where the memory model knows a trainer rank holds a rollout unit beside its "
            "training state at the settings it trains with (GPU types), off elsewhere (CPU pools, untyped "
            "GPUs, colocated); `config validate` says which"
        ),
    )
    rollout_sp: int = Field(1, gt=0, description="sequence parallelism: devices per rollout worker (Ulysses)")
    trainer_sp: int = Field(1, gt=0, description="sequence parallelism: devices per trainer rank (Ulysses)")
    max_staleness: Literal[0, 1] = Field(
        0, description="1 = one-step async (disaggregated only): rollout k+1 with version k"
    )
    max_restarts: int = Field(
        3, ge=0, description="restarts per rollout worker / reward actor before the run stops"
    )
    trainer_restarts: int = Field(
        0,
        ge=0,
        description=(
            "a dead trainer rank (or member of a trainer group): restart every worker from the last "
            "checkpoint, up to this many times (0: the run stops with a resume hint)"
        ),
    )
    group_timeout_s: float = Field(
        1800.0,
        gt=0,
        description=(
            "a unit of work running longer than this has a member blocked (a hung collective: NCCL "
            "peers never raise): the driver takes its group down and restarts it; also every "
            "collective's timeout"
        ),
    )
    stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "a member of a busy worker's group (or the worker) that answers no ping for this long -- "
            "stopped, dead, or restarted under its waiting peers -- is stalled: the driver takes its "
            "group down and restarts it (engine/stall.py)"
        ),
    )
    weight_sync: Literal["auto", "broadcast", "object_store"] = Field(
        "auto",
        description=(
            "how trainer rank 0 ships each new version to the rollout workers: broadcast = a "
            "torch.distributed group (gloo on CPU, NCCL on GPU), bucketed, received while the worker "
            "generates; object_store = the Ray object store; auto = broadcast when the group forms, else the "
            "object store"
        ),
    )
    rollout_batch: Literal["auto", "trainer"] | int = Field(
        "auto",
        description=(
            "samples per sampling forward of a rollout-only worker: trainer = the train forwards' "
            "batches (on-policy ratio exactly 1); N = N per forward (the ratio 1 to rounding, see "
            "logprob_mismatch); auto = the largest the rollout device holds by the memory model "
            "(trainer on devices of unknown memory: CPU pools, untyped GPUs). TAG trainer ranks and "
            "colocated workers: engine.colocated_batch"
        ),
    )
    colocated_batch: Literal["auto", "trainer"] | int = Field(
        "auto",
        description=(
            "samples per sampling forward of a worker that also trains (a colocated worker, a TAG "
            "trainer rank): trainer = the train forwards' batches (on-policy ratio exactly 1); N = up "
            "to N per forward (the ratio 1 to rounding); auto = the whole unit (or a sharded rank's "
            "share) in one forward on GPUs of known memory (the memory model already holds it), "
            "trainer elsewhere (CPU pools, untyped GPUs)"
        ),
    )
    compile_rollout: Literal["off", "on"] = Field(
        "off", description="torch.compile the rollout workers' transformer (engine.compile_mode)"
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode of engine.compile_rollout (CUDA graphs: reduce-overhead)"
    )
    faults: list[FaultConfig] = Field(
        default_factory=list,
        description=(
            "fault injection (tests, soak): `worker`'s process exits after the work of `unit`, once per run "
            "(a plugin in the worker processes, engine/faults.py); also DIGENRL_FAULTS=worker@unit,..."
        ),
    )

    @field_validator("tag", mode="before")
    @classmethod
    def _tag(cls, value):
        if value in ("on", "off"):
            return value == "on"
        if value is None or isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f"must be auto, on or off (or unset), got {value!r}")

    @field_validator("compile_rollout", mode="before")
    @classmethod
    def _switch(cls, value):
        return on_off(value)

    @field_validator("rollout_batch", "colocated_batch", mode="before")
    @classmethod
    def _batch(cls, value):
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_BATCH:
            return value
        if value in ("auto", "trainer"):
            return value
        raise ValueError(f"must be auto, trainer or a batch size 1..{MAX_BATCH}, got {value!r}")
