"""HunyuanVideo-1.5 adapter: the sampler with noise level 0 reproduces diffusers' own
HunyuanVideo15Pipeline (text to video)."""

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.errors import UserError

HV = ("model.adapter=hunyuan_video15", "model.lora.targets=null", "model.frames=5")


def pipeline_of(ad, pipeline_cls=None, **extra):
    """HunyuanVideo15Pipeline (or ``pipeline_cls``, given ``extra`` modules) over the adapter's own
    modules, its guider at the sampling's scale."""
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipe = (pipeline_cls or HunyuanVideo15Pipeline)(
        **extra,
        text_encoder=None,
        tokenizer=None,
        transformer=ad.transformer,
        vae=ad.vae,
        scheduler=ad.flow_scheduler(dict(ad.scheduler.config)),
        text_encoder_2=None,
        tokenizer_2=None,
        guider=ClassifierFreeGuidance(guidance_scale=ad.sampling.guidance),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_kwargs(ad, cond) -> dict:
    """Both text encoders' embeddings and masks (and the negative prompt's when the guider runs CFG)."""
    keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    b = cond.batched
    out = {k: b[k] for k in keys}
    if ad.uses_cfg():
        out.update({f"negative_{k}": b[f"neg_{k}"] for k in keys})
    return out


def run_both(cfg, steps=4):
    """Our ODE trajectory and the pipeline's (per-step latents via its callback, its decoded video)."""
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(['a red apple with the word "hi"', "a blue sky"])  # one glyph text
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = sample(ad, cond, noise, ad.sigmas(steps), "flow_grpo", 0.0, None).latents
    pipe = pipeline_of(ad)
    seen, step = [], pipe.scheduler.step  # the pipeline has no step callback: record the scheduler's steps

    def recorded(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.append(out[0].clone())
        return out

    pipe.scheduler.step = recorded
    video = pipe(
        **prompt_kwargs(ad, cond),
        latents=noise.clone(),
        num_inference_steps=steps,
        height=cfg.model.height,
        width=cfg.model.width,
        num_frames=cfg.model.frames,
        output_type="pt",
    ).frames
    return ad, noise, ours, torch.stack(seen, 1), video


@pytest.mark.parametrize("guidance", [1.0, 6.0])  # one pass / the guider's CFG
@pytest.mark.parametrize("size", [(16, 16), (16, 24)])
def test_ode_trajectory_equals_hunyuan_video15_pipeline(tiny_cfg, size, guidance):
    h, w = size
    cfg = tiny_cfg(*HV, f"model.height={h}", f"model.width={w}", f"sampling.guidance={guidance}")
    ad, noise, ours, theirs, video = run_both(cfg)
    assert ours.shape[2:] == (4, 3, h // 4, w // 4)  # tiny VAE: 4x spatial, 2x temporal
    assert theirs.shape == ours[:, 1:].shape
    assert torch.allclose(ours[:, 1:], theirs, atol=1e-5, rtol=1e-5), (ours[:, 1:] - theirs).abs().max()
    assert (ours[:, -1] - noise).abs().mean() > 1e-2  # not vacuous: the trajectory moved
    ad.preview = None  # the real-VAE decode (scaling factor) equals the pipeline's decoded video
    assert torch.allclose(ad.decode(ours[:, -1]), video.permute(0, 2, 1, 3, 4), atol=1e-5)


def test_quoted_text_reaches_byt5_and_plain_prompts_are_masked_out(tiny_cfg):
    ad = build_adapter(tiny_cfg(*HV).model, tiny_cfg(*HV).sampling)
    b = ad.encode_prompts(['a sign that says "open"', "a sign"]).batched
    assert b["prompt_embeds_mask_2"][0].sum() > 0 and b["prompt_embeds_mask_2"][1].sum() == 0
    assert b["prompt_embeds_2"][1].abs().sum() == 0


def test_lora_targets_all_exist(tiny_cfg):
    ad = build_adapter(tiny_cfg(*HV).model, tiny_cfg(*HV).sampling)
    names = [n for n, m in ad.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in ad.default_lora_targets:
        assert any(n.endswith("." + target) for n in names), target


@pytest.mark.parametrize(
    "override,field", [("model.height=18", "model.height"), ("model.frames=4", "model.frames")]
)
def test_bad_shape_is_a_user_error(tiny_cfg, override, field):
    cfg = tiny_cfg(*HV, override)
    with pytest.raises(UserError, match=field):
        build_adapter(cfg.model, cfg.sampling)
