"""One-rank FSDP2 dtype check at real width: FLUX.1-dev's width (few blocks) sharded as a trainer rank
shards it (bf16 compute, fp32 masters, ``cast_forward_inputs=False``) over a process group of one rank
(NCCL on a GPU), against the same bf16 weights unsharded.

Forward pre-hooks see what each sharded module gets: the root's inputs keep the dtypes the adapter
passed, the blocks' rotary tables stay fp32; the sharded velocity equals the unsharded one bit for bit.
tests/test_fsdp_dtype.py checks the same on two gloo ranks at tiny widths (FLUX, Wan, HunyuanVideo);
this is the GPU's kernels at real width (benchmarks/gpu_smoke.sh, part ``fsdp_dtype``).

    python benchmarks/gpu_fsdp_dtype.py [--double 2 --single 4] --json OUT.json
    python benchmarks/gpu_fsdp_dtype.py --tiny --device cpu --double 1 --single 1 --json OUT.json
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_realwidth import build  # noqa: E402  (the real-width FLUX of the GPU check)


def leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves(v)]
    return []


def record(seen: dict, key: str):
    """A forward pre-hook noting the dtypes of each named input (positional ones by their name)."""

    def hook(module, args, kwargs):
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        seen.setdefault(key, []).append(
            {name: [str(t.dtype) for t in leaves(v)] for name, v in bound.arguments.items()}
        )

    return hook


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a dry run of the code on CPU")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from digenrl.distributed.blocks import transformer_blocks
    from digenrl.distributed.fsdp import parallelize, trainer_mesh

    dev = torch.device(args.device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    cfg, adapter, model = build(args, dev)  # bf16 weights: what FSDP2 all-gathers from the fp32 masters
    sharded = parallelize(copy.deepcopy(model), trainer_mesh(1, dev.type), param_dtype=torch.bfloat16)
    seen: dict = {}
    sharded.register_forward_pre_hook(record(seen, "root_given"), prepend=True, with_kwargs=True)
    sharded.register_forward_pre_hook(record(seen, "root_seen"), with_kwargs=True)
    for block in transformer_blocks(sharded):
        block.register_forward_pre_hook(record(seen, "block_seen"), with_kwargs=True)
    cond = adapter.encode_prompts([f"prompt {i}" for i in range(args.batch)])
    x = torch.randn((args.batch, *adapter.latent_shape()), generator=torch.Generator().manual_seed(1)).to(dev)
    sigma = torch.tensor([0.9375, 0.3][: args.batch] + [0.5] * max(0, args.batch - 2), device=dev)
    velocities = {}
    for name, net in (("unsharded", model), ("sharded", sharded)):
        adapter.transformer = net
        with torch.no_grad():
            velocities[name] = adapter.velocity(x, sigma, cond).float()
    rotary = sorted({d for call in seen["block_seen"] for n, ds in call.items() if "rotary" in n for d in ds})
    diff = (velocities["sharded"] - velocities["unsharded"]).abs().max().item()
    out = {
        "device": str(dev),
        "backend": backend,
        "tiny": args.tiny,
        "params": sum(p.numel() for p in model.parameters()),
        "root_inputs_unchanged": seen["root_given"] == seen["root_seen"],
        "root_dtypes": seen["root_seen"][0],
        "rotary_dtypes": rotary,
        "velocity_scale": velocities["unsharded"].abs().max().item(),
        "max_abs_diff": diff,
        "equal": bool(torch.equal(velocities["sharded"], velocities["unsharded"])),
    }
    out["ok"] = out["root_inputs_unchanged"] and rotary == ["torch.float32"] and out["equal"]
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
