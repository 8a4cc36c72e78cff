"""Pretrain the small world's generator: a small FLUX.1 (FluxPipeline's own classes: a
FluxTransformer2DModel, an AutoencoderKL, CLIPTextModel + T5EncoderModel with word-level tokenizers)
trained from scratch on digenrl/rewards/smallworld's drawings of its training captions. Seeded; on 2
CPU cores in minutes:

    nice -n 10 .venv/bin/python benchmarks/smallworld_pretrain.py --out models/smallworld_flux

1. the VAE (the tiny FLUX preset's AutoencoderKL config, 2x down and 4 latent channels, without the
   mid-block attention: 2x cheaper a step on CPU, and flat shapes do not need it) learns to
   reconstruct drawings (MSE + a small KL); its ``shift_factor`` / ``scaling_factor`` are set from its
   latents' mean and std, as FLUX.1's are;
2. the transformer and both text encoders learn flow matching (rectified flow, FLUX's convention:
   x_t = (1 - t) x0 + t noise, the velocity noise - x0, t logit-normal) on the VAE's latents, the
   text encoded through ``FluxPipeline.encode_prompt`` itself;
3. the pipeline is saved with ``save_pretrained`` and its samples on the held-out captions are scored
   with the ``smallworld`` reward (GenEval's rules), per category: ``<out>/pretrain.json``.

Details: docs/smallworld.md.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from digenrl.adapters.flux import FLUX_SCHEDULER, TINY_VAE
from digenrl.rewards.smallworld import SmallWorldReward
from digenrl.rewards.smallworld.world import SIZE, TAGS, all_rows, sample_scene, split_rows

TEXT_LEN = 16  # tokens: CLIP's model_max_length and the T5 length (the config's model.max_text_len)
TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6),
    guidance_embeds=False,  # FLUX.1-schnell's kind: no guidance input, one pass a step
)


def words() -> list[str]:
    vocab = sorted({w for r in all_rows() for w in r["prompt"].split()})
    return ["<pad>", "</s>", "<unk>", *vocab]


def tokenizer():
    """A word-level fast tokenizer that ends every prompt with ``</s>`` (CLIP pools at it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=TEXT_LEN,
    )


def build_pipeline(seed: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    n = len(words())
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=n,
            hidden_size=TRANSFORMER["pooled_projection_dim"],
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=TEXT_LEN,
            pad_token_id=0,
            eos_token_id=1,  # not 2: CLIP pools at the first </s> (2 selects its legacy argmax rule)
            bos_token_id=2,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=n,
            d_model=TRANSFORMER["joint_attention_dim"],
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=AutoencoderKL(**TINY_VAE, mid_block_add_attention=False),
        text_encoder=clip,
        tokenizer=tokenizer(),
        text_encoder_2=t5,
        tokenizer_2=tokenizer(),
        transformer=FluxTransformer2DModel(**TRANSFORMER),
    )


def dataset(rows: list[dict], n: int, seed: int, start: int = 0) -> tuple[torch.Tensor, list[str]]:
    """``n`` drawings (N, 3, H, W) in [-1, 1], a category drawn uniformly, then one of its captions;
    ``start`` > 0 draws another set (a resumed run's fresh drawings)."""
    rng = random.Random(seed if start == 0 else f"{seed}:{start}")
    by_tag = {t: [r for r in rows if r["tag"] == t] for t in TAGS}
    images, prompts = [], []
    for i in range(n):
        meta = rng.choice(by_tag[rng.choice(TAGS)])
        img, _ = sample_scene(meta, seed * 10_000_000 + start + i)
        images.append(img)
        prompts.append(meta["prompt"])
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)
    return x * 2 - 1, prompts


def train_vae(vae, images: torch.Tensor, steps: int, batch: int, log) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(1)
    vae.train()
    for step in range(steps):
        x = images[torch.randint(len(images), (batch,), generator=g)]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=g)).sample
        mse = (rec - x).pow(2).mean()
        loss = mse + 1e-6 * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step}: mse {mse.item():.5f}")
    vae.eval()


@torch.no_grad()
def latents_of(vae, images: torch.Tensor) -> torch.Tensor:
    """The posterior means (N, C, h, w) of ``images``, unscaled."""
    return torch.cat([vae.encode(images[i : i + 256]).latent_dist.mode() for i in range(0, len(images), 256)])


def train_flow(pipe, latents, prompts: list[str], args, log, probe, done: int = 0):
    """``args.flow_steps`` AdamW steps; ``done`` flow steps already trained (a resumed run: its own
    batches)."""
    from diffusers import FluxPipeline

    steps, batch, every = args.flow_steps, args.batch, args.eval_every
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    # warm-up, then constant (a run of N steps is the first N steps of a longer one, same seed) or,
    # with --decay, linearly to 0 at the run's last step
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * (1 - s / steps if args.decay else 1.0)
    )
    b, c, h, w = latents.shape
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(TEXT_LEN, 3)
    g = torch.Generator().manual_seed(2 + done)
    for m in modules:
        m.train()
    ema = None
    for step in range(steps):
        idx = torch.randint(len(latents), (batch,), generator=g)
        x0 = FluxPipeline._pack_latents(latents[idx], batch, c, h, w)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.sigmoid(torch.randn(batch, generator=g))  # logit-normal (SD3's rectified flow)
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        embeds, pooled, _ = pipe.encode_prompt(
            prompt=[prompts[i] for i in idx.tolist()], prompt_2=None, max_sequence_length=TEXT_LEN
        )
        v = pipe.transformer(
            hidden_states=xt,
            timestep=t,
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        loss = (v - (noise - x0)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            log(f"flow step {done + step}: loss {ema:.4f}")
        if every and (step + 1) % every == 0 and step + 1 < steps:
            for m in modules:
                m.eval()
            probe(done + step + 1)
            for m in modules:
                m.train()
    for m in modules:
        m.eval()


@torch.no_grad()
def evaluate(pipe, rows: list[dict], per_row: int, steps: int, seed: int) -> dict:
    """GenEval-like scores of the pipeline's samples (``per_row`` seeds a caption), per category and
    their mean (GenEval's overall score)."""
    reward = SmallWorldReward()
    scores: dict[str, list[float]] = {t: [] for t in TAGS}
    for k in range(per_row):
        prompts = [r["prompt"] for r in rows]
        images = pipe(
            prompt=prompts,
            num_inference_steps=steps,
            height=SIZE,
            width=SIZE,
            max_sequence_length=TEXT_LEN,
            generator=torch.Generator().manual_seed(seed + k),
            output_type="pt",
        ).images
        for r, s in zip(rows, reward.score(images, prompts, rows).tolist()):
            scores[r["tag"]].append(s)
    by_tag = {t: float(np.mean(v)) for t, v in scores.items()}
    return {
        "by_tag": by_tag,
        "overall": float(np.mean(list(by_tag.values()))),
        "samples": per_row * len(rows),
    }


@torch.no_grad()
def vae_ceiling(vae, rows: list[dict], per_row: int) -> dict:
    """The reward on VAE reconstructions of held-out drawings (their own captions): what a perfect
    generator of latents would score, per category."""
    reward = SmallWorldReward()
    scenes = [(r, sample_scene(r, 20_000 + k)[0]) for k in range(per_row) for r in rows]
    x = torch.from_numpy(np.stack([img for _, img in scenes])).permute(0, 3, 1, 2) * 2 - 1
    rec = (vae.decode(vae.encode(x).latent_dist.mode()).sample / 2 + 0.5).clamp(0, 1)
    scores = reward.score(rec, [r["prompt"] for r, _ in scenes], [r for r, _ in scenes]).tolist()
    return {t: float(np.mean([s for (r, _), s in zip(scenes, scores) if r["tag"] == t])) for t in TAGS}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=int, default=16_000)
    ap.add_argument("--vae-steps", type=int, default=800)
    ap.add_argument("--flow-steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=500, help="flow steps between score probes (0: none)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--decay", action="store_true", help="the learning rate decays linearly to 0")
    ap.add_argument("--resume", type=Path, help="train on from this script's output (its VAE kept)")
    ap.add_argument("--eval-seeds", type=int, default=4, help="samples per held-out caption")
    ap.add_argument("--sample-steps", type=int, default=16, help="ODE steps (as digenrl eval's)")
    ap.add_argument("--keep-probes", action="store_true", help="save the pipeline at each probe")
    ap.add_argument("--json", type=Path, help="also write pretrain.json's content here")
    ap.add_argument("--threads", type=int, default=1, help="1: tiny ops gain nothing from more")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    train, test = split_rows(args.seed)
    before = json.loads((args.resume / "pretrain.json").read_text()) if args.resume else {}
    done = before.get("flow_steps_total", before.get("command", {}).get("flow_steps", 0))
    images, prompts = dataset(train, args.images, args.seed, start=done and 5 * 10**6 + done)
    log(f"{len(images)} drawings of {len(train)} training captions")
    if args.resume:
        from diffusers import FluxPipeline

        pipe = FluxPipeline.from_pretrained(args.resume)
        raw = latents_of(pipe.vae, images)
        shift, scale = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    else:
        pipe = build_pipeline(args.seed)
        train_vae(pipe.vae, images, args.vae_steps, args.batch, log)
        raw = latents_of(pipe.vae, images)
        shift, scale = raw.mean().item(), 1 / raw.std().item()
        pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    log(f"vae latents: shift_factor {shift:.4f}, scaling_factor {scale:.4f}")
    pipe.set_progress_bar_config(disable=True)
    ceiling = vae_ceiling(pipe.vae, test, args.eval_seeds)
    log(f"the detector on VAE reconstructions of held-out drawings: {ceiling}")
    curve = []

    def probe(step):
        r = evaluate(pipe, test, 1, args.sample_steps, seed=10_000)
        curve.append({"step": step, **r})
        log(f"flow step {step}: held-out score {r['overall']:.3f} {r['by_tag']}")
        if args.keep_probes:  # the pipeline as a run of --flow-steps {step} ends (same seed)
            pipe.save_pretrained(args.out / f"step-{step}", safe_serialization=True)

    train_flow(pipe, (raw - shift) * scale, prompts, args, log, probe, done)
    result = evaluate(pipe, test, args.eval_seeds, args.sample_steps, seed=10_000)
    log(f"held-out GenEval-like score {result['overall']:.3f}: {result['by_tag']}")
    pipe.save_pretrained(args.out, safe_serialization=True)
    meta = {
        "command": vars(args) | {"out": str(args.out), "resume": args.resume and str(args.resume)},
        "resumed": before,  # the run this one trained on from (its pretrain.json), if any
        "flow_steps_total": done + args.flow_steps,
        "eval": result,
        "vae_ceiling": ceiling,
        "curve": curve,
        "seconds": round(time.time() - t0),
    }
    meta["command"].pop("json")
    for path in (args.out / "pretrain.json", args.json):
        if path is not None:
            path.write_text(json.dumps(meta, indent=1) + "\n")
    log(f"saved {args.out}")


if __name__ == "__main__":
    main()
