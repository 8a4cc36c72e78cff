"""What a dedicated rollout worker gains, measured on this device (the GPU check's numbers for the
planner's defaults; benchmarks/fold_gpu_check.py reads them):

    python benchmarks/gpu_dedicated.py --gpu H200 --json OUT/dedicated.json
    python benchmarks/gpu_dedicated.py --tiny --device cpu --json F      (a dry run of the code, any machine)

- ``rollout_batch_curve``: one sampling step of the real-width FLUX (gpu_realwidth.py's model: a
  random-init FLUX.1-dev-width transformer, 2 double + 4 single blocks, bf16, 1024 + 512 tokens)
  through the project's sampler at batch 1, 2, 4, 8 -- seconds per step, per sample, and its MFU at
  that call's token count: the kernel-efficiency curve of digenrl/planner/efficiency.py
  (``engine.rollout_batch``);
- ``compile``: the same sampling at ``--compile-batch`` eager and through the engine's
  ``compile_transformer`` (``engine.compile_rollout: on``, ``--compile-mode``): step times, the
  first compiled call (compilation), and the largest difference of latents / log-probs from eager;
- ``reward``: a model reward's seconds per image on the device, built through the reward registry as
  a run builds it (``reward.components``) from a random-init CLIP of the real backbone's width,
  written to a temporary directory (no download): PickScore's ViT-H/14 and CLIPScore's ViT-L/14 (the
  aesthetic reward is ViT-L/14 + a small MLP: CLIPScore's time), on decoded-size images, one group's
  images (one distinct prompt) per call, with the backbone's parameters and the device memory it held;
- ``reward_overlap``: PickScore scoring in another thread while the FLUX samples a unit on the same
  device, as ``EngineWorker.score`` runs beside the next unit: the share of the reward's time hidden
  (``CostParams.model_reward_overlap``);

Each section is written to the JSON as soon as it is done (a run stopped at its time limit keeps what
it measured); a section that fails is recorded under ``errors`` and the script exits 1 at the end.
``--tiny`` shrinks every model (the CPU dry run the tests use; its numbers mean nothing). On CPU the
MFU is not defined (no peak FLOP/s): null. ``--compile-backend eager`` traces without code generation
(the dry run's way to keep seconds; the GPU check uses inductor, the engine's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # test_model_rewards.make_tiny_clip

import torch  # noqa: E402
from gpu_realwidth import PEAK_BF16_FLOPS, build, flops_per_forward, sync, timed  # noqa: E402

CLIP_VOCAB = 49408  # OpenAI CLIP's / open_clip's text vocabulary
#: CLIP backbones of the model rewards (transformers CLIPConfig widths), by reward
BACKBONES = {
    "pickscore": (  # laion/CLIP-ViT-H-14 (PickScore_v1 fine-tunes it)
        "ViT-H/14",
        dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16),
        dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
        1024,
    ),
    "clipscore": (  # openai/clip-vit-large-patch14
        "ViT-L/14",
        dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
        dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
        768,
    ),
}


def write_clip(path: Path, which: str, tiny: bool) -> Path:
    """A random-init CLIPModel directory with a byte-level tokenizer and a 224 px processor config
    (the tests' tiny CLIP, ``tiny``, or the real backbone's width)."""
    from test_model_rewards import make_tiny_clip  # tokenizer + processor files (and the tiny model)
    from transformers import CLIPConfig, CLIPModel

    make_tiny_clip(path, image_size=32 if tiny else 224)
    if tiny:
        return path
    _, vision, text, proj = BACKBONES[which]
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=CLIP_VOCAB,  # (the byte-level tokenizer uses ids < 514; the embedding: real size)
            max_position_embeddings=77,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
        | text,
        vision_config=dict(image_size=224, patch_size=14) | vision,
        projection_dim=proj,
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init on the device: seconds
        model = CLIPModel(cfg)
    model.to(torch.bfloat16).save_pretrained(path)  # the reward casts to its own dtype when it loads
    return path


def curve(args, dev, cfg, ad, model) -> dict:
    """Seconds per sampling step at each batch, per sample, and the MFU at that token count."""
    from digenrl.algorithms.sde import sample

    sigmas, kind, eta = ad.sigmas(args.steps), cfg.sampling.sde, cfg.sampling.noise_level
    tokens = ad.latent_shape()[0] + args.text_len
    peak = PEAK_BF16_FLOPS.get(args.gpu) if dev.type == "cuda" else None
    out = {}
    for b in args.curve_batches:
        cond = ad.encode_prompts([f"prompt {i}" for i in range(b)])
        z = torch.randn((b, *ad.latent_shape()), generator=torch.Generator().manual_seed(2)).to(dev)
        with torch.no_grad():
            t, _ = timed(
                dev, lambda: sample(ad, cond, z, sigmas, kind, eta, torch.Generator().manual_seed(3))
            )
        step = t / args.steps
        out[str(b)] = {
            "step_s": step,
            "per_sample_s": step / b,
            "tokens_per_call": b * tokens,
            "mfu": b * flops_per_forward(model, tokens) / (step * peak) if peak else None,
        }
    return out


def compiled_vs_eager(args, dev, cfg, ad) -> dict:
    """Eager, then the engine's compile_transformer on the same weights: step times, compilation, diffs."""
    from digenrl.policy.model import compile_transformer

    b = args.compile_batch
    run = sampler(args, dev, cfg, ad, b)
    t_eager, eager = timed(dev, run, args.repeats)
    if args.compile_backend == "inductor":
        compile_transformer(SimpleNamespace(adapter=ad), args.compile_mode)  # engine.compile_rollout: on
    else:  # the dry run: dynamo traces, no code generation
        ad.transformer.compile(backend=args.compile_backend, dynamic=None)
    sync(dev)
    t0 = time.perf_counter()
    run()  # the first call compiles
    sync(dev)
    first = time.perf_counter() - t0
    t_comp, compiled = timed(dev, run, args.repeats)
    return {
        "batch": b,
        "mode": args.compile_mode,
        "backend": args.compile_backend,
        "eager_step_s": t_eager / args.steps,
        "compiled_step_s": t_comp / args.steps,
        "speedup": t_eager / t_comp,
        "compile_s": max(0.0, first - t_comp),
        "max_abs_diff_latents": (compiled.latents - eager.latents).abs().max().item(),
        "max_abs_diff_log_probs": (compiled.log_probs - eager.log_probs).abs().max().item(),
    }


def sampler(args, dev, cfg, ad, batch: int):
    """One unit's sampling at ``batch`` (the project's sampler), as a no-argument call."""
    from digenrl.algorithms.sde import sample

    sigmas, kind, eta = ad.sigmas(args.steps), cfg.sampling.sde, cfg.sampling.noise_level
    cond = ad.encode_prompts([f"prompt {i}" for i in range(batch)])
    z = torch.randn((batch, *ad.latent_shape()), generator=torch.Generator().manual_seed(4)).to(dev)

    def run():
        with torch.no_grad():
            return sample(ad, cond, z, sigmas, kind, eta, torch.Generator().manual_seed(5))

    return run


def overlap(args, dev, sample, score) -> dict:
    """``EngineWorker.score``'s situation: a unit scored in another thread while the next one samples
    on the same device. ``hidden_share`` = (sampling + scoring - both at once) / scoring: the share of
    the reward's time hidden behind the sampling (``CostParams.model_reward_overlap``)."""

    def scored_beside():
        def run():
            with torch.no_grad():  # (grad mode is per thread)
                score()

        thread = threading.Thread(target=run)
        thread.start()
        sample()
        thread.join()

    t_sample, _ = timed(dev, sample, args.repeats)
    t_score, _ = timed(dev, score, args.repeats)
    t_both, _ = timed(dev, scored_beside, args.repeats)
    return {
        "sample_s": t_sample,
        "score_s": t_score,
        "both_s": t_both,
        "hidden_share": min(1.0, max(0.0, (t_sample + t_score - t_both) / t_score)),
    }


def reward_rows(args, dev, pixels: int, sample=None, res: dict | None = None) -> list[dict]:
    """Seconds per image of each model reward, built by the registry from a random-init backbone;
    with ``sample``, PickScore's overlap with it (:func:`overlap`) into ``res["reward_overlap"]``."""
    from digenrl.config.train import RewardConfig
    from digenrl.rewards import build_reward

    rows = []
    for which, (name, *_rest) in BACKBONES.items():
        with tempfile.TemporaryDirectory() as tmp:
            path = write_clip(Path(tmp) / which, which, args.tiny)
            args_ = {"path": str(path), "device": str(dev), "dtype": args.reward_dtype}
            fn = build_reward(RewardConfig(components=[{"name": which, "args": args_}]))
            params = sum(p.numel() for p in fn.terms[0][2].backbone.model.parameters())
            held = torch.cuda.memory_allocated() / 2**30 if dev.type == "cuda" else None
            for n in args.reward_images:
                images = torch.rand(n, 3, pixels, pixels, generator=torch.Generator().manual_seed(n))
                prompts = ["a photo of a red car on a street"] * n  # one group: one distinct prompt
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                with torch.no_grad():
                    t, _ = timed(dev, lambda: fn(images, prompts, [{}] * n), args.repeats)
                rows.append(
                    {
                        "reward": which,
                        "backbone": "tiny" if args.tiny else name,
                        "dtype": args.reward_dtype,
                        "images": n,
                        "pixels": pixels,
                        "s_per_image": t / n,
                        "params": params,
                        "held_gib": held,
                        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
                    }
                )
            if sample is not None and res is not None and which == "pickscore":
                n = max(args.reward_images)
                images = torch.rand(n, 3, pixels, pixels, generator=torch.Generator().manual_seed(0))
                prompts = ["a photo of a red car on a street"] * n
                res["reward_overlap"] = {"reward": which, "images": n, "sample_batch": args.compile_batch} | (
                    overlap(args, dev, sample, lambda: fn(images, prompts, [{}] * n))
                )
            fn = None  # (the backbone is freed before the next one loads)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--curve-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=3, help="timed calls after one warm-up")
    ap.add_argument("--compile-batch", type=int, default=4)
    ap.add_argument("--compile-mode", default="default", help="engine.compile_mode")
    ap.add_argument(
        "--compile-backend", default="inductor", help="inductor (the engine's) or eager (dry run)"
    )
    ap.add_argument("--reward-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reward-images", type=int, nargs="+", default=[1, 16], help="images per reward call")
    ap.add_argument("--skip", nargs="*", default=[], choices=["rollout_batch_curve", "compile", "reward"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu", default="H200", help="peak bf16 FLOPs for MFU: " + ", ".join(PEAK_BF16_FLOPS))
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a dry run of the code on CPU")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.tiny:
        args.text_len = min(args.text_len, 16)
    dev = torch.device(args.device)
    res: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "gpu": args.gpu if dev.type == "cuda" else None,
        "tiny": args.tiny,
        "torch": torch.__version__,
        "args": vars(args) | {"json": None},
        "errors": {},
    }

    def save():
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1, default=float))

    def section(name, fn):
        if name in args.skip:
            return
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as exc:  # noqa: BLE001  (recorded; the other sections still run)
            res["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        res.setdefault("seconds", {})[name] = time.perf_counter() - t0
        print(f"gpu_dedicated: {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
        save()

    cfg, ad, model = build(args, dev)
    res["model"] = {
        "params": sum(p.numel() for p in model.parameters()),
        "tokens": ad.latent_shape()[0] + args.text_len,
        "steps": args.steps,
    }
    section("rollout_batch_curve", lambda: curve(args, dev, cfg, ad, model))
    sample = sampler(args, dev, cfg, ad, args.compile_batch)  # (eager: before the compile section)
    section("reward", lambda: reward_rows(args, dev, 32 if args.tiny else 512, sample, res))
    section("compile", lambda: compiled_vs_eager(args, dev, cfg, ad))  # last: it changes the transformer
    print(json.dumps(res, indent=1, default=float))
    save()
    sys.exit(1 if res["errors"] else 0)


if __name__ == "__main__":
    main()
