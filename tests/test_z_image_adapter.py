"""Z-Image adapter: the sampler with noise level 0 reproduces diffusers' own ZImagePipeline."""

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.errors import UserError

Z = ("model.adapter=z_image", "model.lora.targets=null")


def pipeline_of(ad):
    """ZImagePipeline over the adapter's own modules (no text encoder: prompts come as embeddings)."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline(
        scheduler=ad.flow_scheduler(dict(ad.scheduler.config)),
        vae=ad.vae,
        text_encoder=None,
        tokenizer=None,
        transformer=ad.transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_kwargs(ad, cond) -> dict:
    """The conditioning as ZImagePipeline.encode_prompt returns it: each caption's valid tokens."""
    b = cond.batched

    def listed(embeds, mask):
        return [e[m.bool()] for e, m in zip(embeds, mask)]

    negative = listed(b["neg_prompt_embeds"], b["neg_mask"]) if ad.uses_cfg() else None
    return {"prompt_embeds": listed(b["prompt_embeds"], b["mask"]), "negative_prompt_embeds": negative}


def run_both(cfg, steps=5):
    """Our ODE trajectory and the pipeline's (per-step latents via its callback, its decoded images)."""
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a red apple on a table", "a blue sky"])
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = sample(ad, cond, noise, ad.sigmas(steps), "flow_grpo", 0.0, None).latents
    pipe = pipeline_of(ad)
    seen = []
    images = pipe(
        **prompt_kwargs(ad, cond),
        guidance_scale=cfg.sampling.guidance,
        latents=noise.clone(),
        num_inference_steps=steps,
        height=cfg.model.height,
        width=cfg.model.width,
        output_type="pt",
        callback_on_step_end=lambda p, i, t, kw: seen.append(kw["latents"].clone()) or {},
    ).images
    return ad, noise, ours, torch.stack(seen, 1), images


@pytest.mark.parametrize("guidance", [0.0, 4.0])  # Turbo's one pass / the base model's CFG
@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_ode_trajectory_equals_z_image_pipeline(tiny_cfg, size, guidance):
    h, w = size
    cfg = tiny_cfg(*Z, f"model.height={h}", f"model.width={w}", f"sampling.guidance={guidance}")
    ad, noise, ours, theirs, images = run_both(cfg)
    assert ours.shape[2:] == (4, h // 2, w // 2)  # spatial latents: the tiny VAE compresses 2x
    assert theirs.shape == ours[:, 1:].shape
    assert torch.allclose(ours[:, 1:], theirs, atol=1e-5, rtol=1e-5), (ours[:, 1:] - theirs).abs().max()
    assert (ours[:, -1] - noise).abs().mean() > 1e-2  # not vacuous: the trajectory moved
    ad.preview = None  # the real-VAE decode (scale, shift) equals the pipeline's decoded output
    assert torch.allclose(ad.decode(ours[:, -1]), images, atol=1e-5)


def test_sigmas_and_timestep_as_the_pipeline_computes_them(tiny_cfg):
    cfg = tiny_cfg(*Z)
    ad = build_adapter(cfg.model, cfg.sampling)
    s = ad.sigmas(4)
    base = torch.linspace(1.0, 0.25, 4)
    assert torch.allclose(s[:-1], 3 * base / (1 + 2 * base)) and s[-1] == 0  # Turbo's fixed shift 3
    t = ad.timestep(s[:-1])
    assert t.dtype == torch.float32 and torch.allclose(t, 1 - s[:-1], atol=1e-6)  # 0 = noise, 1 = clean


def test_guidance_is_the_pipelines_cfg_and_zero_is_one_pass(tiny_cfg):
    cfg = tiny_cfg(*Z, "sampling.guidance=3.0")
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a green frog"])
    x = ad.initial_noise(1, torch.Generator().manual_seed(0))
    sig = torch.tensor([0.7])
    calls = []
    hook = ad.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    v = ad.velocity(x, sig, cond)
    t = ad.timestep(sig)
    pos = ad.forward_pass(x, t, ad.pass_inputs(cond, False))
    neg = ad.forward_pass(x, t, ad.pass_inputs(cond, True))
    assert torch.allclose(v, pos + 3.0 * (pos - neg), atol=1e-6) and not torch.allclose(v, pos)
    ad.sampling.guidance = 0.0
    calls.clear()
    assert torch.allclose(ad.velocity(x, sig, cond), pos) and len(calls) == 1
    hook.remove()


def test_text_encoder_is_a_real_qwen3_and_padding_is_masked(tiny_cfg):
    from transformers import Qwen3Model

    ad = build_adapter(tiny_cfg(*Z).model, tiny_cfg(*Z).sampling)
    assert isinstance(ad.text.model, Qwen3Model)
    cond = ad.encode_prompts(["a red apple", "a red apple on a wooden table"])
    assert cond.batched["mask"].sum(1).tolist() == [3, 7]
    assert torch.equal(cond.batched["prompt_embeds"][0, :3], cond.batched["prompt_embeds"][1, :3])  # causal


def test_lora_targets_all_exist(tiny_cfg):
    ad = build_adapter(tiny_cfg(*Z).model, tiny_cfg(*Z).sampling)
    names = [n for n, _ in ad.transformer.named_modules()]
    for target in ad.default_lora_targets:
        assert any(n.endswith("." + target) for n in names), target


@pytest.mark.parametrize(
    "override,field", [("model.height=18", "model.height"), ("model.frames=3", "model.frames")]
)
def test_bad_shape_is_a_user_error(tiny_cfg, override, field):
    cfg = tiny_cfg(*Z, override)
    with pytest.raises(UserError, match=field):
        build_adapter(cfg.model, cfg.sampling)
