"""Hardware the planner knows: a small table of accelerators and the cluster-file schema.

Every number in :data:`DEVICES` is the vendor's datasheet value for the SXM / board variant
named (dense, i.e. without 2:4 sparsity); the comment on each row names the document. The
planner only uses them through the cost model, which multiplies peak FLOP/s by a kernel efficiency
(:data:`KERNEL_EFFICIENCY`, scaled by the tokens per call: ``efficiency.py``) and memory bandwidth by
a bandwidth efficiency (``params.CostParams``).

A cluster file describes pools of devices::

    name: 8xH800_16xH20
    gpus_per_node: 8
    interconnect: {bandwidth_gb_s: 50, latency_us: 10}   # between nodes, per device
    pools:
      - {name: h800, device: H800, count: 8}
      - {name: h20, device: H20, count: 16}

``device: cpu`` pools are logical CPU devices (one engine worker process each) on one host with
``host_cores`` cores (default: this machine's); the simulator shares those cores between the
workers that compute at the same time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from digenrl.config import PoolConfig, first_duplicate
from digenrl.errors import UserError
from digenrl.yamlfile import parse_yaml

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16_flops: float  # dense peak BF16 tensor FLOP/s
    mem_bw: float  # device memory bandwidth, bytes/s
    memory: float  # device memory, bytes
    link_bw: float  # GPU-to-GPU bandwidth inside a node, per GPU, one direction, bytes/s
    host_bw: float  # host <-> device (PCIe), one direction, bytes/s
    kind: str = "gpu"  # "gpu" | "cpu"


DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989.5 dense;
    # 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s (bidirectional -> 450 one way); PCIe Gen5 128 GB/s (64 one way)
    "H100": DeviceSpec("H100", 989.5 * TB, 3.35 * TB, 80 * GB, 450 * GB, 64 * GB),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS sparse -> 989.5 dense;
    # 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s
    "H200": DeviceSpec("H200", 989.5 * TB, 4.8 * TB, 141 * GB, 450 * GB, 64 * GB),
    # NVIDIA H800 SXM5 product brief: the H100 SXM5 compute and memory (989.5 dense BF16 TFLOPS,
    # 80 GB HBM3, 3.35 TB/s) with NVLink reduced to 400 GB/s; PCIe Gen5 128 GB/s
    "H800": DeviceSpec("H800", 989.5 * TB, 3.35 * TB, 80 * GB, 200 * GB, 64 * GB),
    # NVIDIA H20 datasheet: FP16/BF16 tensor 148 TFLOPS (dense), 96 GB HBM3 at 4.0 TB/s,
    # NVLink 900 GB/s, PCIe Gen5 128 GB/s
    "H20": DeviceSpec("H20", 148 * TB, 4.0 * TB, 96 * GB, 450 * GB, 64 * GB),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16 312 TFLOPS (624 sparse), 80 GB HBM2e at
    # 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s
    "A100": DeviceSpec("A100", 312 * TB, 2.039 * TB, 80 * GB, 300 * GB, 32 * GB),
    # NVIDIA L40S datasheet: BF16 tensor 362.05 TFLOPS (733 with sparsity), 48 GB GDDR6 at 864 GB/s,
    # no NVLink: PCIe Gen4 x16 64 GB/s (32 one way) is also the GPU-to-GPU path
    "L40S": DeviceSpec("L40S", 362.05 * TB, 864 * GB, 48 * GB, 32 * GB, 32 * GB),
    # NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090): peak BF16 tensor TFLOPS with FP32
    # accumulate 165.2 (330.4 sparse); 24 GB GDDR6X at 1,008 GB/s; no NVLink, PCIe Gen4 x16
    "RTX4090": DeviceSpec("RTX4090", 165.2 * TB, 1008 * GB, 24 * GB, 32 * GB, 32 * GB),
    # A logical CPU device (one engine worker, one thread): rough nominal numbers, used only when no
    # profile of this CPU is given (a CPU plan should always come with `digenrl profile --device cpu`).
    "cpu": DeviceSpec("cpu", 50e9, 20 * GB, 16 * GB, 5 * GB, 5 * GB, kind="cpu"),
}

#: (sampling, training) peak kernel efficiency -- share of peak bf16 FLOP/s at large token counts
#: (efficiency.py scales it down for small calls) -- per device type. Hopper (H100 / H800 and the same
#: GH100 compute in H200): fitted by benchmarks/peer_calibration.py to veRL-Omni's published step
#: (verl-project/verl-omni PR #52 phase breakdown of run_qwen_image_ocr_lora.sh, Qwen-Image LoRA r64,
#: 4xH800, 408.8 s: generation 228.2 s, update_actor 109.3 s, old_log_prob 32.0 s), the fit in
#: docs/scaling.md ("Calibration on published numbers"), until a GPU profile replaces it.
CALIBRATED_HOPPER = (0.216, 0.301)
KERNEL_EFFICIENCY: dict[str, tuple[float, float]] = {
    "H100": CALIBRATED_HOPPER,
    "H800": CALIBRATED_HOPPER,
    "H200": CALIBRATED_HOPPER,
}
KERNEL_EFFICIENCY_SOURCE = (
    "calibrated on veRL-Omni's published Qwen-Image step (benchmarks/peer_calibration.py)"
)
#: every other type: typical values for bf16 DiT kernels with FlashAttention, never measured
GENERIC_EFFICIENCY = (0.40, 0.35)


def kernel_efficiency(device: str) -> tuple[float, float, str]:
    """(sampling, training, source) peak kernel efficiency of a device type (KERNEL_EFFICIENCY)."""
    if device in KERNEL_EFFICIENCY:
        return (*KERNEL_EFFICIENCY[device], KERNEL_EFFICIENCY_SOURCE)
    return (*GENERIC_EFFICIENCY, "default, not measured")


ALIASES = {"RTX 4090": "RTX4090", "4090": "RTX4090", "GEFORCE RTX 4090": "RTX4090"}


def known_devices() -> list[str]:
    return list(DEVICES)


def _lookup(name: str) -> DeviceSpec | None:
    key = ALIASES.get(name.upper(), name)
    return next((spec for k, spec in DEVICES.items() if k.lower() == key.lower()), None)


def _unknown(name: str) -> str:
    return f"unknown device type '{name}' (known: {', '.join(known_devices())})"


def device_spec(name: str, where: str = "device") -> DeviceSpec:
    """The table row for ``name`` (case-insensitive); UserError listing the known types otherwise."""
    spec = _lookup(name)
    if spec is None:
        raise UserError(f"{where}: {_unknown(name)}")
    return spec


def match_device_name(full_name: str) -> str | None:
    """A table key for a CUDA device name such as 'NVIDIA H100 80GB HBM3' (longest key first, so that
    'H200' is not read as 'H20')."""
    upper = full_name.upper().replace("GEFORCE ", "")
    for key in sorted([k for k in DEVICES if k != "cpu"] + list(ALIASES), key=len, reverse=True):
        if key.upper() in upper:
            return ALIASES.get(key, key)
    return None


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
            spec = _lookup(p.device)
            if spec is None:
                raise ValueError(f"pools.{i}.device: {_unknown(p.device)}")
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
    if not path.is_file():
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
    from digenrl.placement import device_type

    pools = [{"name": p.name, "device": device_type(p), "count": p.count} for p in cfg.cluster.pools]
    return cluster_from_dict({"name": "config", "pools": pools})
