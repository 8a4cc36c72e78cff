"""FLUX.1 Kontext and Qwen-Image-Edit: the sampler with noise level 0 reproduces diffusers' own
FluxKontextPipeline and QwenImageEditPipeline on the same prompt embeddings, input image and noise."""

import pytest
import torch
from PIL import Image

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.errors import UserError

KONTEXT = ("model.adapter=flux_kontext", "model.lora.targets=null")
QWEN_EDIT = ("model.adapter=qwen_image_edit", "model.lora.targets=null")
PROMPTS = ["make the apple red", "a blue sky"]


def edit_images(tmp_path, h, w) -> list[str]:
    """Two input images with structure (a gradient and a disc), written as PNG."""
    paths = []
    for i, colour in enumerate([(200, 40, 40), (30, 60, 220)]):
        img = Image.new("RGB", (w, h), colour)
        for x in range(w):
            for y in range(h):
                if (x - w / 2) ** 2 + (y - h / 2) ** 2 < (h / 4) ** 2 or (x + y + i) % 7 == 0:
                    img.putpixel((x, y), (x * 255 // w, y * 255 // h, 128))
        paths.append(str(tmp_path / f"src{i}.png"))
        img.save(paths[-1])
    return paths


def trajectory(ad, cond, noise, steps):
    return sample(ad, cond, noise, ad.sigmas(steps), "flow_grpo", 0.0, None).latents


def edit_pipeline(family, ad, monkeypatch=None):
    """The family's diffusers pipeline over the adapter's components (no text encoders). Qwen-Image-Edit's
    conditioning area (1024^2) is set to the tiny preset's through the pipeline's own
    ``calculate_dimensions``."""
    from diffusers import FluxKontextPipeline, QwenImageEditPipeline

    parts = dict(
        transformer=ad.transformer, scheduler=ad.flow_scheduler(dict(ad.scheduler.config)), vae=ad.vae
    )
    if family == "flux_kontext":
        none = dict.fromkeys(["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"])
        pipe = FluxKontextPipeline(**parts, **none)
    else:
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as module

        area, real = ad.condition_area(ad.cfg), module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions", lambda _area, ratio: real(area, ratio))
        pipe = QwenImageEditPipeline(**parts, text_encoder=None, tokenizer=None, processor=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(pipe, family, cfg, cond, noise, images, steps, i, output_type="pt"):
    """The pipeline on sample i alone (it resizes one input image per call): its per-step latents and
    its output."""
    b, h, w = cond.batched, cfg.model.height, cfg.model.width
    if family == "flux_kontext":
        kw = dict(
            pooled_prompt_embeds=b["pooled"][i : i + 1],
            guidance_scale=cfg.sampling.guidance,
            max_area=h * w,
            _auto_resize=False,
        )
    else:
        kw = dict(prompt_embeds_mask=b["mask"][i : i + 1], true_cfg_scale=cfg.sampling.guidance)
        if cfg.sampling.guidance > 1:
            kw.update(
                negative_prompt_embeds=b["neg_prompt_embeds"][i : i + 1],
                negative_prompt_embeds_mask=b["neg_mask"][i : i + 1],
            )
    seen = []
    out = pipe(
        image=Image.open(images[i]),
        prompt_embeds=b["prompt_embeds"][i : i + 1],
        latents=noise[i : i + 1].clone(),
        num_inference_steps=steps,
        height=h,
        width=w,
        output_type=output_type,
        callback_on_step_end=lambda p, j, t, kw: seen.append(kw["latents"].clone()) or {},
        **kw,
    ).images
    return torch.stack(seen, 1), out


@pytest.mark.parametrize("guidance", [1.0, 2.5])  # the guidance embedding: no guidance / Kontext's 2.5
@pytest.mark.parametrize("size", [(16, 16), (16, 24)])
def test_ode_trajectory_equals_flux_kontext_pipeline(tiny_cfg, tmp_path, size, guidance):
    h, w = size
    cfg = tiny_cfg(*KONTEXT, f"model.height={h}", f"model.width={w}", f"sampling.guidance={guidance}")
    ad = build_adapter(cfg.model, cfg.sampling)
    images = edit_images(tmp_path, h, w)
    cond = ad.cond_for(PROMPTS, images)
    n = (h // 4) * (w // 4)  # tokens: the tiny VAE (2x) then 2x2 patches
    assert cond.batched["image_latents"].shape == (2, n, 16)
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = trajectory(ad, cond, noise, 4)
    ad.preview = None
    pipe = edit_pipeline("flux_kontext", ad)
    for i in range(2):
        theirs, pixels = run_pipeline(pipe, "flux_kontext", cfg, cond, noise, images, 4, i)
        assert torch.allclose(ours[i : i + 1, 1:], theirs, atol=1e-5, rtol=1e-5), (
            (ours[i, 1:] - theirs).abs().max()
        )
        assert torch.allclose(ad.decode(ours[i : i + 1, -1]), pixels, atol=1e-5)
    assert (ours[:, -1] - noise).abs().mean() > 1e-2  # not vacuous: the trajectory moved
    # the input image conditions the result: another image, another trajectory
    swapped = ad.cond_for(PROMPTS, images[::-1])
    assert not torch.allclose(trajectory(ad, swapped, noise, 4), ours)


def test_kontext_conditions_at_the_pipelines_preferred_resolution(tiny_cfg, tmp_path, monkeypatch):
    """With the pipeline's auto-resize (a checkpoint's way), the input image is encoded at the preferred
    Kontext resolution nearest its aspect ratio -- a grid of its own, with its own position ids. Here
    the preferred list is one tiny size, 24 x 32, set in the pipeline's module for both sides."""
    import diffusers.pipelines.flux.pipeline_flux_kontext as module

    from digenrl.adapters.flux_kontext import FluxKontextAdapter

    monkeypatch.setattr(module, "PREFERRED_KONTEXT_RESOLUTIONS", [(32, 24)])  # (width, height)
    monkeypatch.setattr(FluxKontextAdapter, "tiny_at_output_size", False)
    cfg = tiny_cfg(*KONTEXT, "sampling.guidance=2.5")  # 16 x 16 output
    ad = build_adapter(cfg.model, cfg.sampling)
    images = edit_images(tmp_path, 16, 16)
    cond = ad.cond_for(PROMPTS, images)
    assert ad.condition_grid() == (6, 8) and cond.batched["image_latents"].shape == (2, 48, 16)
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = trajectory(ad, cond, noise, 4)
    pipe = edit_pipeline("flux_kontext", ad)
    b = cond.batched
    seen = []
    pipe(
        image=Image.open(images[0]),
        prompt_embeds=b["prompt_embeds"][:1],
        pooled_prompt_embeds=b["pooled"][:1],
        guidance_scale=2.5,
        latents=noise[:1].clone(),
        num_inference_steps=4,
        height=16,
        width=16,
        max_area=16 * 16,
        output_type="latent",
        callback_on_step_end=lambda p, j, t, kw: seen.append(kw["latents"].clone()) or {},
    )  # _auto_resize on: the pipeline's default
    theirs = torch.stack(seen, 1)
    assert torch.allclose(ours[:1, 1:], theirs, atol=1e-5, rtol=1e-5), (ours[0, 1:] - theirs).abs().max()


@pytest.mark.parametrize("guidance", [1.0, 4.0])  # no CFG / true CFG (Qwen-Image-Edit's 4.0)
@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_ode_trajectory_equals_qwen_image_edit_pipeline(tiny_cfg, tmp_path, monkeypatch, size, guidance):
    h, w = size
    cfg = tiny_cfg(*QWEN_EDIT, f"model.height={h}", f"model.width={w}", f"sampling.guidance={guidance}")
    ad = build_adapter(cfg.model, cfg.sampling)
    images = edit_images(tmp_path, h, w)
    cond = ad.cond_for(PROMPTS, images)
    # the conditioning size rounds each side to 32: 32x48 -> 32x64 (round(1.5) = 2), a grid of its own
    ch, cw = {(32, 32): (32, 32), (32, 48): (32, 64)}[size]
    assert cond.batched["image_latents"].shape == (2, (ch // 8) * (cw // 8), 16)
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = trajectory(ad, cond, noise, 4)
    ad.preview = None
    pipe = edit_pipeline("qwen_image_edit", ad, monkeypatch)
    for i in range(2):
        theirs, pixels = run_pipeline(pipe, "qwen_image_edit", cfg, cond, noise, images, 4, i)
        assert torch.allclose(ours[i : i + 1, 1:], theirs, atol=1e-5, rtol=1e-5), (
            (ours[i, 1:] - theirs).abs().max()
        )
        assert torch.allclose(ad.decode(ours[i : i + 1, -1]), pixels, atol=1e-5)
    assert (ours[:, -1] - noise).abs().mean() > 1e-2
    # the stand-in VL encoder sees the image: the same instruction on another image embeds differently
    swapped = ad.cond_for(PROMPTS, images[::-1])
    assert not torch.allclose(swapped.batched["prompt_embeds"], cond.batched["prompt_embeds"])


@pytest.mark.parametrize("family", ["flux_kontext", "qwen_image_edit"])
def test_pretrained_directory_loads_through_the_pipeline(tiny_cfg, tmp_path, monkeypatch, family):
    """A saved FluxKontextPipeline / QwenImageEditPipeline directory (the tiny components, no text
    encoders) loads as ``model.pretrained``: the same transformer weights, the checkpoint's scheduler,
    and the same input-image latents from its VAE."""
    h, w = (16, 16) if family == "flux_kontext" else (32, 32)
    sets = (f"model.adapter={family}", "model.lora.targets=null", f"model.height={h}", f"model.width={w}")
    tiny = build_adapter(tiny_cfg(*sets).model, tiny_cfg(*sets).sampling)
    edit_pipeline(family, tiny, monkeypatch).save_pretrained(tmp_path / "ckpt")
    cfg = tiny_cfg(*sets, f"model.pretrained={tmp_path / 'ckpt'}")
    ad = build_adapter(cfg.model, cfg.sampling)
    a, b = tiny.transformer.state_dict(), ad.transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(ad.sigmas(6), tiny.sigmas(6))
    images = edit_images(tmp_path, h, w)
    # a checkpoint conditions as its pipeline: Kontext at its preferred 1024 x 1024 for a square image,
    # Qwen-Image-Edit at the 1024^2 area (the tiny VAEs: 1024 / 2 / 2 and 1024 / 4 / 2 tokens a side)
    s = tiny.vae_scale
    assert ad.condition_grid() == (1024 // s // 2,) * 2 and tiny.condition_grid() == (
        h // s // 2,
        w // s // 2,
    )
    assert images


@pytest.mark.parametrize(
    "family,override,field",
    [
        ("flux_kontext", "model.height=18", "model.height"),
        ("qwen_image_edit", "model.height=16", "model.height/width"),  # conditioning rounds to 0
        ("qwen_image_edit", "model.frames=1", "model.frames"),
    ],
)
def test_bad_shape_is_a_user_error(tiny_cfg, family, override, field):
    cfg = tiny_cfg(f"model.adapter={family}", "model.lora.targets=null", "model.width=32", override)
    with pytest.raises(UserError, match=field):
        build_adapter(cfg.model, cfg.sampling)


def test_lora_targets_are_flow_grpos_and_all_exist(tiny_cfg):
    from digenrl.policy.lora import matching_modules

    for family, size in (("flux_kontext", 16), ("qwen_image_edit", 32)):
        cfg = tiny_cfg(
            f"model.adapter={family}",
            "model.lora.targets=null",
            f"model.height={size}",
            f"model.width={size}",
        )
        ad = build_adapter(cfg.model, cfg.sampling)
        for target in ad.default_lora_targets:
            assert matching_modules(ad.transformer, target), (family, target)
