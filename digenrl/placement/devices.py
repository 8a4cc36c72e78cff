"""The accelerators DigenRL knows: one row of datasheet facts per device type.

Every number in :data:`DEVICES` is the vendor's datasheet value for the SXM / board variant named
(dense, i.e. without 2:4 sparsity); the comment on each row names the document. The runtime reads
the table for names (a pool's canonical device type, preflight's memory check); the planner reads
it through its cost model (``digenrl.planner``).
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.errors import UserError

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
    # the same datasheet (40GB SXM): 40 GB HBM2 at 1,555 GB/s, the same compute and links
    "A100-40GB": DeviceSpec("A100-40GB", 312 * TB, 1.555 * TB, 40 * GB, 300 * GB, 32 * GB),
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

ALIASES = {"RTX 4090": "RTX4090", "4090": "RTX4090", "GEFORCE RTX 4090": "RTX4090"}


def known_devices() -> list[str]:
    return list(DEVICES)


def lookup_device(name: str) -> DeviceSpec | None:
    key = ALIASES.get(name.upper(), name)
    return next((spec for k, spec in DEVICES.items() if k.lower() == key.lower()), None)


def unknown_device(name: str) -> str:
    return f"unknown device type '{name}' (known: {', '.join(known_devices())})"


def device_spec(name: str, where: str = "device") -> DeviceSpec:
    """The table row for ``name`` (case-insensitive); UserError listing the known types otherwise."""
    spec = lookup_device(name)
    if spec is None:
        raise UserError(f"{where}: {unknown_device(name)}")
    return spec


def match_device_name(full_name: str) -> str | None:
    """A table key for a CUDA device name such as 'NVIDIA H100 80GB HBM3' (longest key first, so that
    'H200' is not read as 'H20')."""
    upper = full_name.upper().replace("GEFORCE ", "")
    if "A100" in upper and "40GB" in upper:  # 'NVIDIA A100-SXM4-40GB': the 40 GB board
        return "A100-40GB"
    for key in sorted([k for k in DEVICES if k != "cpu"] + list(ALIASES), key=len, reverse=True):
        if key.upper() in upper:
            return ALIASES.get(key, key)
    return None
