"""The real-width FLUX train step (forward + backward of one step's log-prob) in the ways the trainer
can hold its weights, each in its own process so that a CUDA error in one cannot poison the next:

- ``fp32_master``: full fine-tuning as ``policy.model`` builds it (fp32 masters, bf16 autocast);
- ``bf16``: full fine-tuning with the parameters left in bf16 (autocast, no masters);
- ``lora``: peft LoRA (rank 64) on the bf16 base, LoRA weights in fp32 (the engine's default);
- ``fp32_master_b1``: ``fp32_master`` at batch 1;
- ``cudnn``: ``fp32_master`` with ``model.cudnn_attention: true`` -- PyTorch may pick cuDNN's attention
  kernel, whose backward failed here on an H200 with torch 2.11.0+cu130
  (benchmarks/gpu_runs/2026-12-04-h200). It says whether the default can change on this torch; its
  failure is reported, not counted.

    python benchmarks/gpu_train_variants.py [--json F] [--variants ...]   (exit 1: a counted variant failed)
    python benchmarks/gpu_train_variants.py --tiny --device cpu      (a dry run of the code)

A variant that fails is run again with CUDA_LAUNCH_BLOCKING=1 and its error's last lines are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

VARIANTS = ("fp32_master", "bf16", "lora", "fp32_master_b1", "cudnn")
INFORMATIONAL = {"cudnn"}


def one(args) -> dict:
    """Build, sample one trajectory, then time the train step of ``args.variant`` (AC off, then on)."""
    import torch
    from gpu_realwidth import PEAK_BF16_FLOPS, build, flops_per_forward, timed

    from digenrl.algorithms.sde import recompute_logprob, sample
    from digenrl.config.model import LoraConfig
    from digenrl.distributed.checkpointing import checkpoint_blocks
    from digenrl.distributed.precision import fp32_master
    from digenrl.policy.lora import apply_lora

    v = args.variant
    dev = torch.device(args.device)
    args.cudnn_attention = v == "cudnn"
    cfg, ad, model = build(args, dev)
    B = 1 if v.endswith("_b1") else args.batch
    cond = ad.encode_prompts([f"prompt {i}" for i in range(B)])
    noise = torch.randn((B, *ad.latent_shape()), generator=torch.Generator().manual_seed(0)).to(dev)
    sigmas = ad.sigmas(args.steps)
    kind, eta = cfg.sampling.sde, cfg.sampling.noise_level
    with torch.no_grad():
        traj = sample(ad, cond, noise, sigmas, kind, eta, torch.Generator().manual_seed(1))
    if v == "lora":
        apply_lora(model, LoraConfig(rank=64, alpha=64, targets=None), ad.default_lora_targets)
    elif v == "bf16":
        model.requires_grad_(True)
    else:
        fp32_master(model.requires_grad_(True))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)

    def step():
        lp, _, _ = recompute_logprob(ad, cond, traj.latents[:, 0], traj.latents[:, 1], sigmas, 0, kind, eta)
        lp.mean().backward()

    tokens = ad.latent_shape()[0] + args.text_len
    # backward = 2 forwards with weight gradients, 1 without (LoRA: the base's are not computed)
    flops = (2 if v == "lora" else 3) * flops_per_forward(model, tokens) * B
    res = {"variant": v, "batch": B, "trained_params": trained, "ok": True}
    for ac in (False, True):
        if ac:
            checkpoint_blocks(model)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t, _ = timed(dev, step, 2)
        res[f"ac_{'on' if ac else 'off'}"] = {
            "step_s": t,
            "mfu": flops / t / PEAK_BF16_FLOPS.get(args.gpu, float("nan")),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
        }
        model.zero_grad(set_to_none=True)
    return res


def run_variant(argv: list[str], variant: str, timeout: float) -> dict:
    """Run one variant in a child process; on failure, once more with CUDA_LAUNCH_BLOCKING=1."""
    cmd = [sys.executable, __file__, *argv, "--variant", variant]
    first_try = None
    for blocking in (False, True):
        env = os.environ | ({"CUDA_LAUNCH_BLOCKING": "1"} if blocking else {})
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "ok": False, "error": f"timed out after {timeout} s"}
        line = [x for x in p.stdout.splitlines() if x.startswith("{")]
        if p.returncode == 0 and line:
            return json.loads(line[-1]) | {"launch_blocking": blocking, "first_try": first_try}
        if blocking:
            tail = p.stderr[-2500:]
            return {
                "variant": variant,
                "ok": False,
                "rc": p.returncode,
                "stderr_tail": tail,
                "first_try": first_try,
            }
        first_try = p.stderr[-600:]
    raise AssertionError("unreachable")


def main():
    from gpu_realwidth import model_args

    ap = model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child's one
    ap.add_argument("--timeout", type=float, default=90)
    args = ap.parse_args()
    if args.tiny:
        args.text_len = min(args.text_len, 16)
    if args.variant:
        print(json.dumps(one(args)))
        return
    rows = []
    for v in args.variants:  # a child given --variant reads the model options and ignores the rest
        rows.append(run_variant(sys.argv[1:], v, args.timeout))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    failed = [r["variant"] for r in rows if not r["ok"] and r["variant"] not in INFORMATIONAL]
    if failed:
        print(f"gpu_train_variants: failed: {' '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
