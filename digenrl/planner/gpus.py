"""Hardware the planner knows: the accelerator table, kernel efficiencies per device type, cluster files.

Details (the cluster-file schema): docs/modules.md, `digenrl.planner.gpus`.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from digenrl.config.base import first_duplicate
from digenrl.config.engine import PoolConfig
from digenrl.config.yamlfile import parse_yaml
from digenrl.errors import UserError
from digenrl.placement.devices import (
    DEVICES,
    lookup_device,
    unknown_device,
)
from digenrl.placement.plan import device_type

#: (sampling, training) kernel efficiency of the matmuls -- share of peak bf16 FLOP/s -- per device type
#: (small calls pay their kernels apart: CostParams.op_launch_s). Hopper (H100 / H800 and the same GH100
#: compute in H200): the one fit over every published row and DigenRL's H200 rows
#: (planner/cost_fit.json, benchmarks/peer_calibration.py; docs/scaling.md, "Calibration on published
#: numbers"), until a GPU profile replaces it.
CALIBRATED_HOPPER = (0.556, 0.312)
KERNEL_EFFICIENCY: dict[str, tuple[float, float]] = {
    "H100": CALIBRATED_HOPPER,
    "H800": CALIBRATED_HOPPER,
    "H200": CALIBRATED_HOPPER,
}
KERNEL_EFFICIENCY_SOURCE = (
    "fitted on every published peer row and DigenRL's H200 rows (benchmarks/peer_calibration.py)"
)
#: (sampling, training) kernel efficiency measured on a device type by the GPU check
#: (benchmarks/gpu_smoke.sh; fold_gpu_check.py): DigenRL's own sampler and train step on a FLUX-width
#: transformer, fitted peaks. Not used for predictions: the calibrated pair above is an effective
#: efficiency of whole steps, and must stay at or below this (docs/real_scale.md, "The first run").
MEASURED_KERNEL_EFFICIENCY: dict[str, tuple[float, float]] = {
    "H200": (0.759, 0.621),  # one H200, torch 2.11.0+cu130, 2026-12-04: benchmarks/gpu_runs/2026-12-04-h200
}
#: every other type: typical values for bf16 DiT kernels with FlashAttention, never measured
GENERIC_EFFICIENCY = (0.40, 0.35)


def kernel_efficiency(device: str) -> tuple[float, float, str]:
    """(sampling, training, source) peak kernel efficiency of a device type (KERNEL_EFFICIENCY)."""
    if device in KERNEL_EFFICIENCY:
        return (*KERNEL_EFFICIENCY[device], KERNEL_EFFICIENCY_SOURCE)
    return (*GENERIC_EFFICIENCY, "default, not measured")


# ------------------------------------------------------------------------------ cluster files


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Interconnect(_Strict):
    bandwidth_gb_s: float = Field(
        50.0, gt=0, description="between nodes, per device, one direction (400 Gb/s IB = 50)"
    )
    latency_us: float = Field(10.0, ge=0)


class ClusterSpec(_Strict):
    name: str = "cluster"
    gpus_per_node: int = Field(8, gt=0)
    interconnect: Interconnect = Field(default_factory=Interconnect)
    host_cores: int | None = Field(
        None, gt=0, description="cpu pools: cores they share (default: this machine's)"
    )
    pools: list[PoolConfig] = Field(
        min_length=1, description="device: a known type (canonical spelling kept)"
    )

    @field_validator("pools")
    @classmethod
    def _known_unique(cls, pools: list[PoolConfig]) -> list[PoolConfig]:
        for i, p in enumerate(pools):
            for key in ("device", "count"):  # a cluster file names both (a run config may default them)
                if key not in p.model_fields_set:
                    raise ValueError(f"pools.{i}.{key}: Field required")
            spec = lookup_device(p.device)
            if spec is None:
                raise ValueError(f"pools.{i}.device: {unknown_device(p.device)}")
            pools[i] = p.model_copy(update={"device": spec.name})  # canonical spelling
        dup = first_duplicate([p.name for p in pools])
        if dup is not None:
            raise ValueError(f"pool name '{dup}' appears twice")
        kinds = {DEVICES[p.device].kind for p in pools}
        if len(kinds) > 1:
            raise ValueError("a cluster mixes cpu and GPU pools; use one or the other")
        return pools

    @property
    def devices(self) -> dict[str, int]:
        """device type -> count over all pools."""
        out: dict[str, int] = {}
        for p in self.pools:
            out[p.device] = out.get(p.device, 0) + p.count
        return out

    @property
    def is_cpu(self) -> bool:
        return DEVICES[self.pools[0].device].kind == "cpu"

    def cores(self) -> int:
        return self.host_cores or os.cpu_count() or 1

    def describe(self) -> str:
        return " + ".join(f"{n}x{d}" for d, n in self.devices.items())


def load_cluster(path: Path) -> ClusterSpec:
    path = Path(path)
    if not path.exists():
        raise UserError(f"--cluster: cluster file not found: {path}")
    data = parse_yaml(path, "--cluster")  # one line for non-UTF-8, malformed YAML, a duplicate key
    if not isinstance(data, dict):
        raise UserError(f"{path}: a cluster file is a mapping with 'pools' (got {type(data).__name__})")
    data.setdefault("name", path.stem)
    return cluster_from_dict(data, str(path))


def cluster_from_dict(data: dict, where: str = "cluster") -> ClusterSpec:
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "cluster"
        msg = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            msg = "unknown key"
        if msg.startswith(f"{loc}."):  # a list validator naming the element itself (pools.0.device: ...)
            loc, msg = msg.split(": ", 1)
        raise UserError(f"{where}: {loc}: {msg}") from None


def cluster_from_run_config(cfg) -> ClusterSpec:
    """The cluster a RunConfig's ``cluster.pools`` describes (devices 'gpu'/'cuda' are not a type)."""
    pools = [{"name": p.name, "device": device_type(p), "count": p.count} for p in cfg.cluster.pools]
    return cluster_from_dict({"name": "config", "pools": pools})
