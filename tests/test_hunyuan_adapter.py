"""HunyuanVideo adapter: the sampler with noise level 0 reproduces diffusers' own HunyuanVideoPipeline."""

from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.config.run import load_config
from digenrl.errors import UserError

TINY = Path(__file__).resolve().parents[1] / "configs" / "hunyuan_tiny.yaml"
PROMPTS = ["a red apple on a wooden table", "blue sky"]  # different lengths: partial masks


def make(*overrides: str):
    cfg = load_config(TINY, list(overrides))
    return cfg, build_adapter(cfg.model, cfg.sampling)


@pytest.fixture(scope="module")
def tiny():
    return make()


@pytest.mark.parametrize("shift", [None, 5.0])
def test_ode_trajectory_equals_hunyuan_pipeline(shift):
    from diffusers import HunyuanVideoPipeline

    cfg, ad = make(f"sampling.shift={'null' if shift is None else shift}", "sampling.guidance=4.5")
    cond = ad.encode_prompts(PROMPTS)
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    steps = 6
    ours = sample(ad, cond, noise, ad.sigmas(steps), "dance_grpo", 0.0, None).latents[:, -1]

    sched = ad.flow_scheduler({**dict(ad.scheduler.config), "shift": shift or 7.0})
    pipe = HunyuanVideoPipeline(
        text_encoder=None,
        tokenizer=None,
        transformer=ad.transformer,
        vae=ad.vae,
        scheduler=sched,
        text_encoder_2=None,
        tokenizer_2=None,
    )
    theirs = pipe(
        prompt_embeds=cond.batched["prompt_embeds"],
        pooled_prompt_embeds=cond.batched["pooled"],
        prompt_attention_mask=cond.batched["mask"],
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=4.5,
        height=cfg.model.height,
        width=cfg.model.width,
        num_frames=cfg.model.frames,
        output_type="latent",
    ).frames
    assert theirs.shape == ours.shape == (2, 4, 3, 4, 4)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()
    assert (ours - noise).abs().mean() > 1e-2  # not vacuous: the trajectory moved


def test_sigmas_follow_the_pipeline_schedule(tiny):
    _, ad = tiny
    s = ad.sigmas(8)
    shift, u = 7.0, torch.linspace(1, 0, 9)[:-1].double()
    expect = torch.cat([shift * u / (1 + (shift - 1) * u), torch.zeros(1, dtype=torch.float64)])
    assert s.dtype == torch.float32 and s.shape == (9,)
    assert torch.allclose(s.double(), expect, atol=1e-6)


def test_decode_shape_and_range(tiny):
    cfg, ad = tiny
    x = ad.initial_noise(2, torch.Generator().manual_seed(0))
    video = ad.decode(x)
    assert video.shape == (2, 3, cfg.model.frames, cfg.model.height, cfg.model.width)
    assert video.min() >= 0 and video.max() <= 1


def test_prompt_mask_is_left_aligned_and_used(tiny):
    _, ad = tiny
    cond = ad.encode_prompts(PROMPTS)
    mask = cond.batched["mask"]
    lengths = mask.sum(1)
    assert lengths.tolist() == [7, 2]
    assert torch.equal(mask.bool(), torch.arange(mask.shape[1])[None] < lengths[:, None])  # a prefix

    x = ad.initial_noise(2, torch.Generator().manual_seed(1))
    sig = torch.full((2,), 0.7)
    v = ad.velocity(x, sig, cond)
    # padding beyond the valid prefix is ignored ...
    padded = cond.select(slice(None))
    padded.batched["prompt_embeds"] = cond.batched["prompt_embeds"] + (1 - mask[..., None].float()) * 3.0
    assert torch.allclose(ad.velocity(x, sig, padded), v, atol=1e-6)
    # ... but only because the mask says so: a full mask attends to the padding and changes the output
    full = cond.select(slice(None))
    full.batched["mask"] = torch.ones_like(mask)
    assert (ad.velocity(x, sig, full) - v).abs().max() > 1e-4


def test_velocity_has_gradients(tiny):
    _, ad = tiny
    cond = ad.encode_prompts(PROMPTS[:1])
    v = ad.velocity(ad.initial_noise(1, torch.Generator().manual_seed(2)), torch.full((1,), 0.5), cond)
    v.square().mean().backward()
    grads = [p.grad for p in ad.transformer.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    ad.transformer.zero_grad(set_to_none=True)


def test_default_lora_targets_all_match(tiny):
    _, ad = tiny
    names = [n for n, _ in ad.transformer.named_modules()]
    for target in ad.default_lora_targets:
        assert any(n == target or n.endswith("." + target) for n in names), target


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.frames=8", "model.frames"),
        ("model.frames=null", "model.frames"),
        ("model.height=40", "model.height"),
        ("model.width=24", "model.width"),
    ],
)
def test_bad_shapes_are_user_errors(override, field):
    with pytest.raises(UserError, match=field):
        make(override)


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(UserError, match="not found"):
        make("model.preset=null", f"model.pretrained={tmp_path / 'nope'}")
    with pytest.raises(UserError, match=f"{tmp_path}.*model_index.json"):
        make("model.preset=null", f"model.pretrained={tmp_path}")


def test_left_padded_tokenizer_mask_is_rejected(tiny):
    _, ad = tiny

    class LeftPaddingPipe:  # stands in for a checkpoint whose tokenizer pads on the left
        def encode_prompt(self, prompt, device, max_sequence_length):
            mask = torch.tensor([[0, 0, 1, 1]])
            return torch.zeros(1, 4, 16), torch.zeros(1, 8), mask

    ad.pipe = LeftPaddingPipe()
    try:
        with pytest.raises(UserError, match="pad on the right"):
            ad.encode_prompts(["x"])
    finally:
        ad.pipe = None
