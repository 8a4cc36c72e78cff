"""HunyuanVideo-1.5 image to video: the sampler with noise level 0 reproduces diffusers' own
HunyuanVideo15ImageToVideoPipeline on the same prompt embeddings, first frame and noise."""

import pytest
import torch
from PIL import Image

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.errors import UserError
from tests.test_edit_adapters import edit_images
from tests.test_hunyuan_video15_adapter import prompt_kwargs

I2V = ("model.adapter=hunyuan_video15_i2v", "model.lora.targets=null", "model.frames=5")
PROMPTS = ['a red apple with the word "hi"', "a blue sky"]  # one glyph text


def i2v_pipeline(ad):
    """HunyuanVideo15ImageToVideoPipeline over the adapter's modules (no text encoders), its guider at
    the sampling's scale."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    from tests.test_hunyuan_video15_adapter import pipeline_of

    return pipeline_of(
        ad,
        HunyuanVideo15ImageToVideoPipeline,
        image_encoder=ad.image_encoder,
        feature_extractor=ad.feature_extractor,
    )


def run_pipeline(pipe, ad, cond, noise, image, frames, steps, i, output_type="pt"):
    """The pipeline on sample i alone (one input image per call): its per-step latents, its video."""
    seen, step = [], pipe.scheduler.step  # no step callback: record the scheduler's steps

    def recorded(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.append(out[0].clone())
        return out

    pipe.scheduler.step = recorded
    one = cond.select(slice(i, i + 1))
    video = pipe(
        image=Image.open(image),
        **prompt_kwargs(ad, one),
        latents=noise[i : i + 1].clone(),
        num_inference_steps=steps,
        num_frames=frames,
        output_type=output_type,
    ).frames
    return torch.stack(seen, 1), video


@pytest.mark.parametrize("guidance", [1.0, 6.0])  # one pass / the guider's CFG (the 480p i2v default)
@pytest.mark.parametrize("shape", [(16, 16, 5), (12, 16, 9)])  # buckets of the tiny target_size 16
def test_ode_trajectory_equals_hunyuan_video15_i2v_pipeline(tiny_cfg, tmp_path, shape, guidance):
    h, w, f = shape
    sets = (f"model.height={h}", f"model.width={w}", f"model.frames={f}", f"sampling.guidance={guidance}")
    cfg = tiny_cfg(*I2V, *sets)
    ad = build_adapter(cfg.model, cfg.sampling)
    images = edit_images(tmp_path, h, w)
    cond = ad.cond_for(PROMPTS, images)
    b = cond.batched
    assert b["image_latents"].shape == (2, 4, 1, h // 4, w // 4) and b["image_embeds"].shape == (2, 729, 16)
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = sample(ad, cond, noise, ad.sigmas(4), "flow_grpo", 0.0, None).latents
    assert ours.shape[2:] == (4, (f - 1) // 2 + 1, h // 4, w // 4)
    ad.preview = None  # the real-VAE decode, as the pipeline's
    pipe = i2v_pipeline(ad)
    for i in range(2):
        theirs, video = run_pipeline(pipe, ad, cond, noise, images[i], f, 4, i)
        assert torch.allclose(ours[i : i + 1, 1:], theirs, atol=1e-5, rtol=1e-5), (
            (ours[i, 1:] - theirs).abs().max()
        )
        assert torch.allclose(ad.decode(ours[i : i + 1, -1]), video.permute(0, 2, 1, 3, 4), atol=1e-5)
    assert (ours[:, -1] - noise).abs().mean() > 1e-2  # not vacuous: the trajectory moved
    # the first frame conditions the result: the other image, another trajectory
    swapped = sample(ad, ad.cond_for(PROMPTS, images[::-1]), noise, ad.sigmas(4), "flow_grpo", 0.0, None)
    assert not torch.allclose(swapped.latents, ours)


def test_both_image_paths_reach_the_transformer(tiny_cfg, tmp_path):
    """The first-frame latents and the SigLIP embeddings each move the velocity (neither is masked out,
    as t2v's zeros are)."""
    ad = build_adapter(tiny_cfg(*I2V).model, tiny_cfg(*I2V).sampling)
    cond = ad.encode_prompts(PROMPTS[:1], edit_images(tmp_path, 16, 16)[:1])
    x, s = ad.initial_noise(1, torch.Generator().manual_seed(0)), torch.full((1,), 0.7)
    v = ad.velocity(x, s, cond)
    for key in ("image_latents", "image_embeds"):
        other = type(cond)({**cond.batched, key: -cond.batched[key]})  # (a shift: LayerNorm'd away)
        assert (ad.velocity(x, s, other) - v).abs().mean() > 1e-3, key


def test_an_output_size_that_is_not_its_own_bucket_is_a_user_error(tiny_cfg):
    cfg = tiny_cfg(*I2V, "model.height=16", "model.width=24")  # the pipeline would generate 12 x 16
    with pytest.raises(UserError, match=r"model.height/width: .* gives 12x16"):
        build_adapter(cfg.model, cfg.sampling)


def test_a_prompt_without_its_image_is_refused(tiny_cfg):
    ad = build_adapter(tiny_cfg(*I2V).model, tiny_cfg(*I2V).sampling)
    with pytest.raises(ValueError, match="an image per prompt"):
        ad.encode_prompts(["a red apple"], [None])


def test_a_trainer_rank_releases_the_image_encoder(tiny_cfg):
    ad = build_adapter(tiny_cfg(*I2V).model, tiny_cfg(*I2V).sampling)
    ad.release_generation_modules()
    assert ad.image_encoder is None and ad.feature_extractor is None
