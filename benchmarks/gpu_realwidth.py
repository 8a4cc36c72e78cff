"""Real-width FLUX check on one GPU: a random-init FLUX.1-dev-width transformer
(hidden 3072 = 24 heads x 128, T5 width 4096, pooled 768; a few blocks) in bf16, 512 px-sized
token count (1024 image + 512 text tokens), through the project's own sampler and loss path.

    python benchmarks/gpu_realwidth.py [--double 2 --single 4 --batch 4 --steps 8] [--json F]
    python benchmarks/gpu_realwidth.py --tiny --device cpu      (a dry run of the code, any machine)

Prints, per phase, peak device memory beside a static prediction (weights, fp32 masters,
gradients, AdamW state: bytes per parameter; activations are what the measurement adds), the
rollout step time beside diffusers' FluxPipeline at the same shape, the train step time
(forward + backward, with and without activation checkpointing) and its MFU, the fingerprint
and bucket-packing bandwidth on the device vs SHA-256 of host bytes (LoRA- and full-sized), and
the on-policy ratio exp(logp_recomputed - logp_rollout) on the GPU kernels. The same model's
sampling at batch 1, 2, 4, 8 (the kernel-efficiency curve), compiled vs eager, and the reward models'
time per image: benchmarks/gpu_dedicated.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "H20": 148e12}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(dev, fn, repeats=3):
    fn()  # warm-up
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    sync(dev)
    return (time.perf_counter() - t0) / repeats, out


def host_syncs(dev, fn, steps: int) -> dict | None:
    """The calls that make the host wait for the device while ``fn`` runs (``steps`` sampling steps),
    as torch's sync debug mode reports them (a pageable host-to-device copy, ``.item()``, ...): per
    step, and the distinct messages. None off CUDA, where there is nothing to wait for."""
    if dev.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        seen = synchronizing_warnings(fn)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"per_step": len(seen) / steps, "kinds": sorted(set(seen))[:8]}


def synchronizing_warnings(fn) -> list[str]:
    """The first line of every warning about a synchronizing CUDA call that ``fn`` raises."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    lines = [str(w.message).splitlines()[0] for w in caught]
    return [m for m in lines if "synchroniz" in m]


def peak_gib(dev, reset=True):
    if dev.type != "cuda":
        return float("nan")
    v = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return v


def build(args, dev):
    from diffusers import FluxTransformer2DModel

    from digenrl.adapters import build_adapter
    from digenrl.adapters.tiny_text import HashTextEncoder
    from digenrl.config.run import load_config

    if args.tiny:
        width = dict(
            num_attention_heads=2,
            attention_head_dim=16,
            joint_attention_dim=64,
            pooled_projection_dim=32,
            axes_dims_rope=(4, 4, 8),
        )
    else:  # FLUX.1-dev
        width = dict(
            num_attention_heads=24,
            attention_head_dim=128,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            axes_dims_rope=(16, 56, 56),
        )
    # the tiny preset's VAE packs 4 latent channels: in_channels 16 (FLUX.1-dev: 64; only x_embedder differs)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=args.double,
        num_single_layers=args.single,
        guidance_embeds=True,
        **width,
    )
    model.to(dev, torch.bfloat16)
    # 128 px through the tiny VAE (scale 2, 2x2 packing) = 1024 image tokens, as FLUX at 512 px
    px = 32 if args.tiny else 128
    cfg = load_config(
        None,
        [
            "model.dtype=bfloat16",
            f"model.height={px}",
            f"model.width={px}",
            f"model.max_text_len={args.text_len}",
            f"sampling.steps={args.steps}",
            f"model.cudnn_attention={getattr(args, 'cudnn_attention', False)}",
        ],
    )
    adapter = build_adapter(cfg.model, cfg.sampling, dev)
    adapter.transformer = model
    adapter.text = HashTextEncoder(
        width["joint_attention_dim"], args.text_len, width["pooled_projection_dim"]
    )
    return cfg, adapter, model


def flops_per_forward(model, tokens: int) -> float:
    """2 x matmul parameters x tokens + attention (QK^T and AV: 4 x tokens^2 x hidden per block)."""
    from digenrl.distributed.blocks import transformer_blocks

    blocks = transformer_blocks(model)
    block_params = sum(p.numel() for b in blocks for p in b.parameters() if p.dim() == 2)
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    return 2 * block_params * tokens + 4 * tokens**2 * hidden * len(blocks)


def model_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model's size and the device: the options this script shares with gpu_train_variants.py."""
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu", default="H200", help="peak bf16 FLOPs for MFU: " + ", ".join(PEAK_BF16_FLOPS))
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a dry run of the code on CPU")
    ap.add_argument("--json", type=Path)
    return ap


def main():
    args = model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()
    if args.tiny:
        args.text_len = min(args.text_len, 16)
    dev = torch.device(args.device)
    res: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "args": vars(args) | {"json": None},
    }
    peak_gib(dev)

    from digenrl.algorithms.sde import recompute_logprob, sample
    from digenrl.distributed.checkpointing import checkpoint_blocks
    from digenrl.distributed.precision import fp32_master

    cfg, ad, model = build(args, dev)
    n_params = sum(p.numel() for p in model.parameters())
    res["params"] = n_params
    res["build"] = {"peak_gib": peak_gib(dev), "predicted_gib": n_params * 2 / 2**30}

    # ---- rollout: the project's sampler vs FluxPipeline at the same token count
    B, N = args.batch, args.steps
    cond = ad.encode_prompts([f"prompt {i}" for i in range(B)])
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn((B, *ad.latent_shape()), generator=gen).to(dev)
    sigmas = ad.sigmas(N)
    kind, eta = cfg.sampling.sde, cfg.sampling.noise_level
    with torch.no_grad():
        t_roll, traj = timed(
            dev, lambda: sample(ad, cond, noise, sigmas, kind, eta, torch.Generator().manual_seed(1)), 2
        )
    tokens = ad.latent_shape()[0] + args.text_len
    res["rollout"] = {
        "step_s": t_roll / N,
        "batch": B,
        "tokens": tokens,
        "peak_gib": peak_gib(dev),
        "predicted_static_gib": n_params * 2 / 2**30,
    }
    from diffusers import FluxPipeline

    pipe = FluxPipeline(
        scheduler=ad.flow_scheduler(ad.scheduler.config),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=model,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe_px = (
        8 * 2 * int(ad.latent_shape()[0] ** 0.5)
    )  # vae scale 8 without a VAE, 2x2 packing: same token count
    embeds, pooled = (
        cond.batched["prompt_embeds"].to(torch.bfloat16),
        cond.batched["pooled"].to(torch.bfloat16),
    )
    with torch.no_grad():
        t_pipe, _ = timed(
            dev,
            lambda: pipe(
                prompt_embeds=embeds,
                pooled_prompt_embeds=pooled,
                height=pipe_px,
                width=pipe_px,
                num_inference_steps=N,
                guidance_scale=cfg.sampling.guidance,
                output_type="latent",
            ),
            2,
        )
    res["rollout"]["flux_pipeline_step_s"] = t_pipe / N
    with torch.no_grad():  # what makes the host wait in our sampler's steps (the 1.12x lead, real_scale.md)
        res["rollout"]["host_syncs"] = host_syncs(
            dev, lambda: sample(ad, cond, noise, sigmas, kind, eta, torch.Generator().manual_seed(1)), N
        )

    # ---- on-policy ratio on the device's kernels: recompute each step's log-prob, same batch, in the
    # trainer's grad mode (autograd on, trained parameters requiring grad: the kernels it picks), and,
    # for comparison, under no_grad as the rollout ran
    def log_ratios(grad: bool) -> list[float]:
        trained = [p for p in model.parameters() if not p.requires_grad]
        for p in trained:
            p.requires_grad_(grad)
        try:
            with torch.set_grad_enabled(grad):
                out = []
                for i in range(N):
                    lp, _, _ = recompute_logprob(
                        ad, cond, traj.latents[:, i], traj.latents[:, i + 1], sigmas, i, kind, eta
                    )
                    out.append((lp.detach() - traj.log_probs[:, i]).abs().max().item())
                return out
        finally:
            for p in trained:
                p.requires_grad_(False)

    diffs, diffs_no_grad = log_ratios(True), log_ratios(False)
    res["on_policy"] = {
        "grad_mode": True,
        "max_abs_log_ratio": max(diffs),
        "max_ratio_minus_1": float(torch.tensor(max(diffs)).exp() - 1),
        "max_abs_log_ratio_no_grad": max(diffs_no_grad),
    }

    # ---- train (full fine-tuning, fp32 masters, AdamW): fwd + bwd at one step, with and without AC
    fp32_master(model.requires_grad_(True))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    peak_gib(dev)
    i = 0

    def train_step():
        lp, _, _ = recompute_logprob(
            ad, cond, traj.latents[:, i], traj.latents[:, i + 1], sigmas, i, kind, eta
        )
        lp.mean().backward()
        return None

    flops = 3 * flops_per_forward(model, tokens) * B
    peak = PEAK_BF16_FLOPS.get(args.gpu, float("nan"))
    static_train = n_params * (4 + 4) / 2**30  # fp32 masters + fp32 grads (before AdamW state exists)
    for ac in (False, True):
        if ac:
            checkpoint_blocks(model)
        t_train, _ = timed(dev, train_step, 2)
        res[f"train_ac_{'on' if ac else 'off'}"] = {
            "step_s": t_train,
            "mfu": flops / t_train / peak,
            "peak_gib": peak_gib(dev),
            "predicted_static_gib": static_train,
        }
        opt.zero_grad(set_to_none=True)
    train_step()
    t0 = time.perf_counter()
    opt.step()
    sync(dev)
    res["optimizer_step"] = {
        "s": time.perf_counter() - t0,
        "peak_gib": peak_gib(dev),
        "predicted_static_gib": n_params * (4 + 4 + 8) / 2**30,
    }

    # ---- weight sync on the device: fingerprint and bucket packing vs SHA-256 of host bytes
    from digenrl.distributed.fingerprint import fingerprint
    from digenrl.policy.lora import checksum

    full = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    lora_like = {
        f"l{j}": torch.randn(64, 3072, device=dev, dtype=torch.bfloat16)
        for j in range(16 * (args.double + args.single))
    }
    rows = []
    for what, state in (("lora_like", lora_like), ("full", full)):
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        t_fp, _ = timed(dev, lambda: [fingerprint(t) for t in state.values()], 2)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def pack():
            off = 0
            for t in state.values():
                k = t.numel() * t.element_size()
                buf[off : off + k].copy_(t.reshape(-1).view(torch.uint8))
                off += k

        t_pack, _ = timed(dev, pack, 2)
        t_sha, _ = timed(dev, lambda: checksum(state), 1)
        rows += [
            {
                "what": what,
                "bytes": nbytes,
                "fingerprint_gb_s": nbytes / t_fp / 1e9,
                "pack_gb_s": nbytes / t_pack / 1e9,
                "sha256_with_copy_gb_s": nbytes / t_sha / 1e9,
            }
        ]
    res["weight_sync"] = rows
    res["weight_sync_note"] = (
        "NCCL broadcast between processes needs 2 GPUs: not measured on one"
        if torch.cuda.device_count() < 2
        else "run benchmarks/weight_sync.py for the broadcast itself"
    )
    print(json.dumps(res, indent=1, default=float))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=float))


if __name__ == "__main__":
    main()
