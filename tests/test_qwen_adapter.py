"""Qwen-Image adapter: the sampler with noise level 0 reproduces diffusers' own QwenImagePipeline."""

import re
from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.errors import UserError

QWEN = ("model.adapter=qwen_image",)


def stock_pipeline(ad):
    """diffusers' QwenImagePipeline over the adapter's own modules (the text given as embeddings)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(
        scheduler=ad.flow_scheduler(dict(ad.scheduler.config)),
        vae=ad.vae,
        text_encoder=None,
        tokenizer=None,
        transformer=ad.transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_both(cfg, steps=6):
    """Our ODE trajectory and the pipeline's (per-step latents via its callback, plus its decoded images)."""
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a red apple on a table", "a blue sky"])
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = sample(ad, cond, noise, ad.sigmas(steps), "flow_grpo", 0.0, None).latents

    pipe = stock_pipeline(ad)
    seen = []
    images = pipe(
        prompt_embeds=cond.batched["prompt_embeds"],
        prompt_embeds_mask=cond.batched["mask"],
        negative_prompt_embeds=cond.batched["neg_prompt_embeds"],
        negative_prompt_embeds_mask=cond.batched["neg_mask"],
        true_cfg_scale=cfg.sampling.guidance,
        latents=noise.clone(),
        num_inference_steps=steps,
        height=cfg.model.height,
        width=cfg.model.width,
        output_type="pt",
        callback_on_step_end=lambda p, i, t, kw: seen.append(kw["latents"].clone()) or {},
    ).images
    return ad, noise, ours, torch.stack(seen, 1), images


@pytest.mark.parametrize("size", [(32, 32), (32, 48)])  # non-square: img_shapes must follow the grid
def test_ode_trajectory_equals_qwen_pipeline_true_cfg(tiny_cfg, size):
    h, w = size
    cfg = tiny_cfg(*QWEN, f"model.height={h}", f"model.width={w}", "sampling.guidance=4.0")
    ad, noise, ours, theirs, images = run_both(cfg)
    assert ad.img_shapes(2) == [[(1, h // 8, w // 8)]] * 2  # tiny VAE: 4x, then 2x2 packing
    assert theirs.shape == ours[:, 1:].shape
    assert torch.allclose(ours[:, 1:], theirs, atol=1e-5, rtol=1e-5), (ours[:, 1:] - theirs).abs().max()
    # and the comparison is not vacuous: the trajectory moved away from the noise
    assert (ours[:, -1] - noise).abs().mean() > 1e-2
    # the real-VAE decode (unpack + latents_mean/std + frame squeeze) equals the pipeline's decoded output
    ad.preview = None
    assert torch.allclose(ad.decode(ours[:, -1]), images, atol=1e-5)


def test_guidance_changes_velocity_and_keeps_conditional_norm(tiny_cfg):
    cfg = tiny_cfg(*QWEN, "sampling.guidance=4.0")
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a green frog"])
    x = ad.initial_noise(1, torch.Generator().manual_seed(0))
    sig = torch.tensor([0.7])
    v = ad.velocity(x, sig, cond)
    ad.sampling.guidance = 1.0
    v_cond = ad.velocity(x, sig, cond)
    assert not torch.allclose(v, v_cond)
    assert torch.allclose(v.norm(dim=-1), v_cond.norm(dim=-1), rtol=1e-5)  # norm rescale per token


def test_gradient_flows_through_both_cfg_passes(tiny_cfg):
    cfg = tiny_cfg(*QWEN, "sampling.guidance=4.0")
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a green frog"])
    x = ad.initial_noise(1, torch.Generator().manual_seed(0))
    ad.velocity(x, torch.tensor([0.5]), cond).square().mean().backward()
    w = ad.transformer.transformer_blocks[0].attn.add_q_proj.weight  # text stream: differs per pass
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_decode_shape_and_range(tiny_cfg):
    cfg = tiny_cfg(*QWEN, "model.height=32", "model.width=48")
    ad = build_adapter(cfg.model, cfg.sampling)
    img = ad.decode(ad.initial_noise(3, torch.Generator().manual_seed(0)))
    assert img.shape == (3, 3, 32, 48)
    assert img.min() >= 0 and img.max() <= 1


def test_lora_targets_all_exist(tiny_cfg):
    cfg = tiny_cfg(*QWEN)
    ad = build_adapter(cfg.model, cfg.sampling)
    names = [n for n, _ in ad.transformer.named_modules()]
    for target in ad.default_lora_targets:
        assert any(n.endswith("." + target) for n in names), target


@pytest.mark.parametrize(
    "override,field", [("model.height=36", "model.height"), ("model.frames=1", "model.frames")]
)
def test_bad_shape_is_a_user_error(tiny_cfg, override, field):
    cfg = tiny_cfg(*QWEN, override)
    with pytest.raises(UserError, match=field):
        build_adapter(cfg.model, cfg.sampling)


def test_missing_or_invalid_checkpoint_dir(tiny_cfg, tmp_path):
    cfg = tiny_cfg(*QWEN, f"model.pretrained={tmp_path / 'nope'}")
    with pytest.raises(UserError, match="not found"):
        build_adapter(cfg.model, cfg.sampling)
    cfg = tiny_cfg(*QWEN, f"model.pretrained={tmp_path}")  # exists, but no model_index.json
    with pytest.raises(UserError, match=re.escape(str(tmp_path))):
        build_adapter(cfg.model, cfg.sampling)


def test_tiny_config_file_loads():
    from digenrl.config.run import load_config

    cfg = load_config(Path(__file__).parents[1] / "configs" / "qwen_tiny.yaml")
    assert cfg.model.adapter == "qwen_image" and cfg.sampling.guidance > 1
