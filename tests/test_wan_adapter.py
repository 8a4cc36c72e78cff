"""Wan adapter: the sampler with noise level 0 reproduces diffusers' own WanPipeline (two-pass CFG)."""

import re
from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.config.run import load_config
from digenrl.errors import UserError

WAN_TINY = Path(__file__).resolve().parents[1] / "configs" / "wan_tiny.yaml"


def wan_cfg(*overrides: str):
    return load_config(WAN_TINY, list(overrides))


@pytest.fixture(scope="module")
def adapter():
    cfg = wan_cfg()
    return build_adapter(cfg.model, cfg.sampling)


def test_ode_trajectory_equals_wan_pipeline(adapter):
    from diffusers import WanPipeline

    ad, m = adapter, adapter.cfg
    g = ad.sampling.guidance
    assert g > 1  # the CFG path
    cond = ad.encode_prompts(["a red apple", "a blue sky"])
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    steps = 6
    ours = sample(ad, cond, noise, ad.sigmas(steps), "flow_grpo", 0.0, None).latents[:, -1]

    shift = ad.sampling.shift or ad.scheduler.config.shift
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=ad.vae,
        transformer=ad.transformer,
        scheduler=ad.flow_scheduler({"shift": shift}),
    )
    theirs = pipe(
        prompt_embeds=cond.batched["prompt_embeds"],
        negative_prompt_embeds=cond.batched["neg_prompt_embeds"],
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=g,
        height=m.height,
        width=m.width,
        num_frames=m.frames,
        output_type="latent",
    ).frames
    assert theirs.shape == ours.shape == (2, *ad.latent_shape())
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()
    # not vacuous: the trajectory moved, and guidance matters (the unconditional pass is used)
    assert (ours - noise).abs().mean() > 1e-2
    no_cfg = pipe(
        prompt_embeds=cond.batched["prompt_embeds"],
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=1.0,
        height=m.height,
        width=m.width,
        num_frames=m.frames,
        output_type="latent",
    ).frames
    assert (no_cfg - theirs).abs().max() > 1e-3


def test_velocity_gradient_flows_through_both_passes(adapter):
    cond = adapter.encode_prompts(["a red apple"])
    pos = cond.batched["prompt_embeds"].clone().requires_grad_(True)
    neg = cond.batched["neg_prompt_embeds"].clone().requires_grad_(True)
    cond.batched.update(prompt_embeds=pos, neg_prompt_embeds=neg)
    x = adapter.initial_noise(1, torch.Generator().manual_seed(0))
    adapter.velocity(x, torch.tensor([0.7]), cond).square().sum().backward()
    assert pos.grad.abs().sum() > 0 and neg.grad.abs().sum() > 0
    adapter.transformer.zero_grad(set_to_none=True)


def test_decode_shape_and_range(adapter):
    m = adapter.cfg
    video = adapter.decode(adapter.initial_noise(2, torch.Generator().manual_seed(0)))
    assert video.shape == (2, 3, m.frames, m.height, m.width)
    assert video.min() >= 0 and video.max() <= 1


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.frames=6", "model.frames"),  # not 4k+1
        ("model.frames=null", "model.frames"),  # a video model needs frames
        ("model.height=36", "model.height"),  # latent side 9: odd after the 2x2 patch
        ("model.width=20", "model.width"),
        ("model.width=264", "model.width"),  # 33 tokens > rope_max_seq_len 32
    ],
)
def test_bad_shapes_are_user_errors(override, field):
    cfg = wan_cfg(override)
    with pytest.raises(UserError, match=field):
        build_adapter(cfg.model, cfg.sampling)


def test_missing_checkpoint(tmp_path):
    cfg = wan_cfg(f"model.pretrained={tmp_path / 'nope'}", "model.preset=null")
    with pytest.raises(UserError, match="not found"):
        build_adapter(cfg.model, cfg.sampling)
    cfg = wan_cfg(f"model.pretrained={tmp_path}", "model.preset=null")  # a directory, but no model_index.json
    with pytest.raises(UserError, match=re.escape(str(tmp_path))):
        build_adapter(cfg.model, cfg.sampling)


def test_pretrained_directory_round_trip(adapter, tmp_path):
    """A tiny checkpoint in the real layout (UMT5 + tokenizer, UniPC with flow_shift as Wan ships) loads
    through build_pretrained; RL sampling uses FlowMatchEuler with the shipped shift; prompts go through
    the pipeline's own encode_prompt."""
    from diffusers import UniPCMultistepScheduler, WanPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "red", "apple", "blue", "sky"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(words),
            d_model=adapter.transformer.config.text_dim,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=2,
        )
    )
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=adapter.vae,
        transformer=adapter.transformer,
        scheduler=unipc,
    ).save_pretrained(tmp_path)

    cfg = wan_cfg(
        f"model.pretrained={tmp_path}",
        "model.preset=null",
        "sampling.shift=null",
        "sampling.negative_prompt=blue sky",
    )
    ad = build_adapter(cfg.model, cfg.sampling)
    assert (
        type(ad.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and ad.scheduler.config.shift == 5.0
    )
    assert ad.latent_shape() == adapter.latent_shape()
    prompts = ["a red apple", "a blue sky"]
    cond = ad.encode_prompts(prompts)
    with torch.no_grad():
        pos, neg = ad.pipe.encode_prompt(prompts, negative_prompt=["blue sky"] * 2, max_sequence_length=16)
    assert torch.allclose(cond.batched["prompt_embeds"], pos, atol=1e-6)
    assert torch.allclose(cond.batched["neg_prompt_embeds"], neg, atol=1e-6)
    assert ad.velocity(
        ad.initial_noise(2, torch.Generator().manual_seed(0)), torch.full((2,), 0.5), cond
    ).shape == (2, *ad.latent_shape())
    # shape checks read the checkpoint's config.json before loading it
    bad = wan_cfg(f"model.pretrained={tmp_path}", "model.preset=null", "model.width=264")
    with pytest.raises(UserError, match="rope_max_seq_len"):
        build_adapter(bad.model, bad.sampling)


def test_real_scale_config_validates():
    cfg = load_config(WAN_TINY.parent / "wan2.1_t2v_14b.yaml")
    # an engine placement (the one `digenrl plan` chooses for 16xH800: colocated), not the local trainer
    assert cfg.model.adapter == "wan" and cfg.placement.mode in ("colocated", "disaggregated")
    assert (cfg.model.frames - 1) % 4 == 0 and cfg.model.height % 16 == 0 and cfg.model.width % 16 == 0
