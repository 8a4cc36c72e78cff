"""Memory at published shapes, without the memory (issue 36, item 4): what one FSDP2 trainer rank holds.

Each family's real-scale config (configs/*.yaml: the published transformer config, as the planner
knows it) is built on the ``meta`` device inside a fake process group of world size 8
(``torch.testing._internal.distributed.fake_pg``: no collective runs). The runtime's own code then
runs unchanged: ``Policy(...)`` for a rank the layout shards (LoRA, fp32 masters, optimizer, KL
reference, EMA, old policy) and ``engine.fsdp_group.shard_trainer_rank`` (FSDP2 per block, then the
root); only the checkpoint load is replaced by the meta build. One gradient and one AdamW step make
the gradients and the optimizer state exist. Each part's bytes on rank 0 are summed from the local
shards; every tensor must be a shard (no full-size copy), and the total is compared with
``planner/memory.py``'s parts (activations and FSDP2's gathered block, which live only inside a
forward, excluded).

``--tag``: also a TAG trainer rank while it rolls out (issue 52: meta_memory_tag.py).
``--build``: the build instead (issue 53, item 4): the device bytes of a rank while its transformer is
moved from host memory and sharded, block by block (``build_audit``).

    python benchmarks/meta_memory_audit.py [--json F] [--markdown] [--only NAME] [--tag]
    python benchmarks/meta_memory_audit.py --build [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
WORLD = 8
GiB = 2**30
# (row name, config, overrides): each family's published recipe, and full fine-tuning with the KL
# reference and EMA (and FLUX with DiffusionNFT's old policy) -- the parts a LoRA run does not hold
CASES = [
    ("flux1_dev LoRA", "flux1_dev.yaml", []),
    ("flux1_dev full FT + KL + EMA", "flux1_dev.yaml", ["model.lora=null", "train.ema={decay: 0.99}"]),
    (
        "flux1_dev full FT, diffusion_nft",
        "flux1_dev.yaml",
        ["model.lora=null", "algorithm.name=diffusion_nft", "algorithm.kl_beta=0"],
    ),
    ("wan2.1_t2v_14b LoRA", "wan2.1_t2v_14b.yaml", []),
    (
        "wan2.1_t2v_14b full FT + KL + EMA",
        "wan2.1_t2v_14b.yaml",
        ["model.lora=null", "train.ema={decay: 0.99}"],
    ),
    ("hunyuan_video LoRA", "hunyuan_video.yaml", []),
    ("hunyuan_video full FT + KL", "hunyuan_video.yaml", ["model.lora=null", "algorithm.kl_beta=0.01"]),
    ("qwen_image LoRA", "qwen_image.yaml", []),
    (
        "qwen_image full FT + KL + EMA",
        "qwen_image.yaml",
        ["model.lora=null", "algorithm.kl_beta=0.01", "train.ema={decay: 0.99}"],
    ),
    ("z_image_turbo LoRA", "z_image_turbo.yaml", []),
    (
        "z_image_turbo full FT + KL + EMA",
        "z_image_turbo.yaml",
        ["model.lora=null", "algorithm.kl_beta=0.01", "train.ema={decay: 0.99}"],
    ),
    ("hunyuan_video15 LoRA", "hunyuan_video15.yaml", []),
    ("flux2_dev LoRA", "flux2_dev.yaml", []),
    ("flux2_dev full FT + KL", "flux2_dev.yaml", ["model.lora=null", "algorithm.kl_beta=0.01"]),
    ("flux2_klein_4b LoRA", "flux2_klein_4b.yaml", []),
    (
        "flux2_klein_4b full FT + KL + EMA",
        "flux2_klein_4b.yaml",
        ["model.lora=null", "algorithm.kl_beta=0.01", "train.ema={decay: 0.99}"],
    ),
]
# the build column (issue 53, item 4): what a rank's device holds while it builds and shards
BUILD_CASES = [
    ("wan2.2_t2v_a14b full FT + KL", "wan2.2_t2v_a14b.yaml", ["model.lora=null", "algorithm.kl_beta=0.01"]),
    ("wan2.2_t2v_a14b LoRA", "wan2.2_t2v_a14b.yaml", []),
    ("flux1_dev full FT + KL + EMA", "flux1_dev.yaml", ["model.lora=null", "train.ema={decay: 0.99}"]),
]
PARTS = ("frozen base", "fp32 masters", "fp32 grads", "AdamW state", "reference", "EMA", "old policy")


def meta_transformer(cfg):
    """The published transformer on ``meta``, loaded as ``from_pretrained(torch_dtype=model.dtype)``
    would: every weight in the model dtype except the class's ``_keep_in_fp32_modules``."""
    import diffusers

    from digenrl.adapters import adapter_class
    from digenrl.planner.shapes import _init_args, model_shape

    shape = model_shape(cfg.model)
    cls = getattr(diffusers, adapter_class(cfg.model.adapter).transformer_class)

    def one():
        with torch.device("meta"):
            net = cls(**{k: v for k, v in shape.config.items() if k in _init_args(cls)})
        net.to(getattr(torch, cfg.model.dtype))
        keep = getattr(cls, "_keep_in_fp32_modules", None) or []
        for name, module in net.named_modules():
            if any(k in name.split(".") for k in keep):
                module.float()
        return net

    if shape.experts == 2:  # Wan2.2 A14B: two experts of one architecture, as adapters/wan22.py holds them
        from digenrl.adapters.experts import Experts
        from digenrl.adapters.wan22 import TRAINED

        return Experts(one(), one(), TRAINED[cfg.model.train_experts]), shape.source
    return one(), shape.source


def local_bytes(t) -> tuple[int, bool]:
    """(bytes this rank holds, whether it is a shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        loc = t.to_local()
        return loc.numel() * loc.element_size(), True
    return t.numel() * t.element_size(), False


def sharded_rank(cfg):
    """(policy, transformer, published source): rank 0 of 8 built and sharded by the runtime's code on
    ``meta``, after one gradient and one AdamW step (gradients and optimizer state exist)."""
    from digenrl.adapters import adapter_class
    from digenrl.engine.fsdp_group import shard_trainer_rank
    from digenrl.placement.layout import RunLayout
    from digenrl.policy import model as policy_model
    from digenrl.policy.settings import single_process_settings

    net, source = meta_transformer(cfg)
    dtype = getattr(torch, cfg.model.dtype)
    adapter = SimpleNamespace(
        transformer=net,
        dtype=dtype,
        default_lora_targets=adapter_class(cfg.model.adapter).default_lora_targets,
    )
    settings = dataclasses.replace(single_process_settings(cfg), fsdp=WORLD, activation_checkpointing=False)
    layout = mock.create_autospec(RunLayout, instance=True, settings=settings)
    layout.will_shard.side_effect = lambda role: role != "rollout"
    with mock.patch.object(policy_model, "build_adapter", lambda *a, **k: adapter):
        policy = policy_model.Policy(cfg, device="cpu", layout=layout)
    shard_trainer_rank(policy, WORLD)  # the runtime's sharding, exactly
    for p in policy.params:  # a backward's gradients, then one step: AdamW's state exists
        p.grad = torch.zeros_like(p)
    policy.optimizer.step()
    return policy, net, source


def audit(name: str, config: str, sets: list[str], rank=None) -> dict:
    """One case's row; ``rank``: a :func:`sharded_rank` of its config already built."""
    from digenrl.config.run import load_config
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.params import CostParams
    from digenrl.planner.workload import Workload

    cfg = load_config(ROOT / "configs" / config, sets)
    policy, net, source = rank or sharded_rank(cfg)
    held = dict.fromkeys(PARTS, 0)
    whole = []  # tensors that are not shards: full-size copies
    keep = set(getattr(net, "_keep_in_fp32_modules", None) or ())
    kept = [0, 0]  # what FSDP leaves whole by design (diffusers' fp32-kept bare parameters): count, bytes

    def add(part, tensors, label):
        for n, t in tensors:
            b, shard = local_bytes(t)
            held[part] += b
            if not shard and keep & set(n.split(".")):
                kept[0], kept[1] = kept[0] + 1, kept[1] + b
            elif not shard:
                whole.append(f"{label} {n}")

    add("frozen base", [(n, p) for n, p in net.named_parameters() if not p.requires_grad], "param")
    add("fp32 masters", [(n, p) for n, p in net.named_parameters() if p.requires_grad], "param")
    add("fp32 grads", [(n, p.grad) for n, p in policy.named_params.items()], "grad")
    states = [
        (f"{n}.{k}", v) for n, p in policy.named_params.items() for k, v in policy.optimizer.state[p].items()
    ]
    add("AdamW state", [(n, v) for n, v in states if v.dim() > 0], "AdamW")
    ref = policy._ref
    if isinstance(ref, torch.nn.Module):
        ref = dict(ref.named_parameters())
    add("reference", (ref or {}).items(), "reference")
    add("EMA", (policy.ema.average if policy.ema else {}).items(), "EMA")
    add("old policy", (policy.old.average if policy.old else {}).items(), "old policy")

    w = Workload.from_config(cfg)
    parts = MemoryModel(w, CostParams()).train_parts(WORLD, 1, False)
    planned = {k: v for k, v in parts.items() if k not in ("activations", "compute copy")}
    total, plan = sum(held.values()), sum(planned.values())
    return {
        "name": name,
        "config": f"configs/{config}",
        "published": source,
        "params": sum(p.numel() for p in net.parameters()),
        "held": held,
        "total": total,
        "planner": plan,
        "planner_parts": planned,
        "difference": (total - plan) / plan,
        "full_size": whole[:5],
        "full_size_count": len(whole),
        "kept_whole_count": kept[0],
        "kept_whole_bytes": kept[1],
    }


def build_audit(name: str, config: str, sets: list[str], device_type: str = "meta") -> dict:
    """The build of one rank of 8, by the runtime's own ``Policy`` and ``fsdp.shard_policy``: the
    published transformer in host memory (``to_empty`` on the CPU: pages reserved, never touched but
    for the one block cast to fp32 at a time), the rank's device played by ``meta`` and every storage
    put there counted (``distributed.build_audit.DeviceBytes``). ``whole``: the transformer's bytes,
    which the build before issue 53 put on every rank's device before sharding. ``device_type``
    ``cuda``: the rank's device is the GPU, its peak ``torch.cuda.max_memory_allocated`` (not yet run)."""
    from digenrl.adapters import adapter_class
    from digenrl.config.run import load_config
    from digenrl.distributed import fsdp
    from digenrl.distributed.blocks import transformer_blocks
    from digenrl.distributed.build_audit import DeviceBytes
    from digenrl.placement.layout import RunLayout
    from digenrl.policy import model as policy_model
    from digenrl.policy.settings import single_process_settings

    cfg = load_config(ROOT / "configs" / config, sets)
    net, source = meta_transformer(cfg)
    whole = sum(p.numel() * p.element_size() for p in net.parameters())
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in transformer_blocks(net))
    net.to_empty(device="cpu")
    adapter = SimpleNamespace(
        transformer=net,
        dtype=getattr(torch, cfg.model.dtype),
        default_lora_targets=adapter_class(cfg.model.adapter).default_lora_targets,
        host_transformer=True,  # as build_adapter leaves it for a rank that will shard
    )
    settings = dataclasses.replace(single_process_settings(cfg), fsdp=WORLD, activation_checkpointing=False)
    layout = mock.create_autospec(RunLayout, instance=True, settings=settings)
    layout.will_shard.side_effect = lambda role: role != "rollout"
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated() if cuda else 0
    with mock.patch.object(policy_model, "build_adapter", lambda *a, **k: adapter):
        with contextlib.nullcontext() if cuda else DeviceBytes("meta") as device:
            policy = policy_model.Policy(cfg, device=device_type, layout=layout)
            mesh = fsdp.trainer_mesh(WORLD, "cuda" if cuda else "cpu")
            fsdp.shard_policy(policy, mesh, independent_replicas=True)
    if cuda:
        device = SimpleNamespace(
            peak=torch.cuda.max_memory_allocated() - start,
            live=torch.cuda.memory_allocated() - start,
            largest=None,
        )
    else:
        device._forget_freed()
    return {
        "name": name,
        "config": f"configs/{config}",
        "published": source,
        "params": sum(p.numel() for p in net.parameters()),
        "whole": whole,
        "block_fp32": block,
        "build_peak": device.peak,
        "build_end": device.live,
        "largest": device.largest,
    }


def build_markdown(rows: list[dict]) -> str:
    lines = [
        "| case | params | whole transformer (old build, per rank) | build peak per rank | "
        "held after the build | largest block, fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["whole"], r["build_peak"], r["build_end"], r["block_fp32"]]
        lines.append(
            f"| {r['name']} | {r['params'] / 1e9:.2f} B | "
            + " | ".join(f"{c / GiB:.2f}" for c in cells)
            + " |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def fake_group(rank: int = 0):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def markdown(rows: list[dict]) -> str:
    head = "| case | params | " + " | ".join(PARTS) + " | total | planner | difference |"
    lines = [head, "|" + "---|" * (len(PARTS) + 5)]
    for r in rows:
        cells = [f"{r['held'][p] / GiB:.2f}" if r["held"][p] else "0" for p in PARTS]
        lines.append(
            f"| {r['name']} | {r['params'] / 1e9:.2f} B | "
            + " | ".join(cells)
            + f" | {r['total'] / GiB:.2f} | {r['planner'] / GiB:.2f} | {r['difference']:+.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", action="store_true", help="print the table for docs/real_scale.md")
    ap.add_argument("--only", action="append", help="cases whose name starts with this (repeatable)")
    ap.add_argument("--build", action="store_true", help="the build column (BUILD_CASES) instead")
    ap.add_argument("--device", default="meta", choices=["meta", "cuda"], help="--build: the rank's device")
    ap.add_argument(
        "--tag", action="store_true", help="also a TAG trainer rank rolling out (meta_memory_tag.py)"
    )
    a = ap.parse_args(argv)
    cases = [
        c
        for c in (BUILD_CASES if a.build else CASES)
        if not a.only or any(c[0].startswith(o) for o in a.only)
    ]
    rows = []
    if a.build:
        with fake_group():
            for case in cases:
                rows.append(build_audit(*case, a.device))
                r = rows[-1]
                gc.collect()  # (the case's FSDP modules hold reference cycles)
                if a.device == "cuda":
                    torch.cuda.empty_cache()
                print(
                    f"{r['name']}: build peak {r['build_peak'] / GiB:.2f} GiB on rank 0 of {WORLD} "
                    f"(whole transformer {r['whole'] / GiB:.2f} GiB)",
                    flush=True,
                )
        if a.markdown:
            print(build_markdown(rows))
        if a.json:
            a.json.write_text(json.dumps({"world": WORLD, "build_rows": rows}, indent=1))
        return 0
    tag_rows = []
    with fake_group():
        for case in cases:
            rows.append(audit(*case))
            r = rows[-1]
            print(
                f"{r['name']}: rank 0 holds {r['total'] / GiB:.2f} GiB, planner {r['planner'] / GiB:.2f} GiB "
                f"({r['difference']:+.1%}), full-size tensors: {r['full_size_count']}",
                flush=True,
            )
        if a.tag:
            from meta_memory_tag import TAG_CASES, tag_audit, tag_markdown

            for case in TAG_CASES:
                tag_rows.append(r := tag_audit(*case))
                print(
                    f"{r['name']}: rank 0 holds {r['total'] / GiB:.2f} GiB while it rolls out, "
                    f"planner {r['planner'] / GiB:.2f} GiB ({r['difference']:+.1%})",
                    flush=True,
                )
    if a.markdown:
        print(markdown(rows))
        if tag_rows:
            print(tag_markdown(tag_rows))
    if a.json:
        a.json.write_text(json.dumps({"world": WORLD, "rows": rows, "tag_rows": tag_rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
