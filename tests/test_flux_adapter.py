"""FLUX adapter: the sampler with noise level 0 reproduces diffusers' own FluxPipeline."""

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.errors import UserError


def test_ode_trajectory_equals_flux_pipeline(tiny_cfg):
    from diffusers import FluxPipeline

    cfg = tiny_cfg("sampling.guidance=2.5")
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a red apple", "a blue sky"])
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    steps = 6
    ours = sample(ad, cond, noise, ad.sigmas(steps), "flow_grpo", 0.0, None).latents[:, -1]

    pipe = FluxPipeline(
        scheduler=ad.flow_scheduler(dict(ad.scheduler.config)),
        vae=ad.vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=ad.transformer,
    )
    theirs = pipe(
        prompt_embeds=cond.batched["prompt_embeds"],
        pooled_prompt_embeds=cond.batched["pooled"],
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=2.5,
        height=cfg.model.height,
        width=cfg.model.width,
        output_type="latent",
    ).images
    assert theirs.shape == ours.shape
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()
    # and the comparison is not vacuous: the trajectory moved away from the noise
    assert (ours - noise).abs().mean() > 1e-2


def test_decode_shape_and_range(tiny_cfg):
    cfg = tiny_cfg()
    ad = build_adapter(cfg.model, cfg.sampling)
    x = ad.initial_noise(3, torch.Generator().manual_seed(0))
    img = ad.decode(x)
    assert img.shape == (3, 3, cfg.model.height, cfg.model.width)
    assert img.min() >= 0 and img.max() <= 1


def test_bad_resolution_is_a_user_error(tiny_cfg):
    cfg = tiny_cfg("model.height=30")
    with pytest.raises(UserError, match="model.height"):
        build_adapter(cfg.model, cfg.sampling)


def test_missing_checkpoint_dir(tiny_cfg, tmp_path):
    cfg = tiny_cfg(f"model.pretrained={tmp_path / 'nope'}")
    with pytest.raises(UserError, match="not found"):
        build_adapter(cfg.model, cfg.sampling)
