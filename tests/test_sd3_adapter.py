"""SD3.5 adapter: the sampler with noise level 0 reproduces diffusers' own StableDiffusion3Pipeline."""

import re
from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.errors import UserError

SD3 = ("model.adapter=sd3", "model.lora.targets=null")


def run_both(cfg, steps=6):
    """Our ODE trajectory and the pipeline's (per-step latents via its callback, plus its decoded images)."""
    from diffusers import StableDiffusion3Pipeline

    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a red apple on a table", "a blue sky"])
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = sample(ad, cond, noise, ad.sigmas(steps), "flow_grpo", 0.0, None).latents

    pipe = StableDiffusion3Pipeline(
        transformer=ad.transformer,
        scheduler=ad.flow_scheduler(dict(ad.scheduler.config)),
        vae=ad.vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    b = cond.batched
    negative = {}
    if cfg.sampling.guidance > 1:
        negative = dict(
            negative_prompt_embeds=b["neg_prompt_embeds"], negative_pooled_prompt_embeds=b["neg_pooled"]
        )
    seen = []
    images = pipe(
        prompt_embeds=b["prompt_embeds"],
        pooled_prompt_embeds=b["pooled"],
        **negative,
        guidance_scale=cfg.sampling.guidance,
        latents=noise.clone(),
        num_inference_steps=steps,
        height=cfg.model.height,
        width=cfg.model.width,
        output_type="pt",
        callback_on_step_end=lambda p, i, t, kw: seen.append(kw["latents"].clone()) or {},
    ).images
    return ad, noise, ours, torch.stack(seen, 1), images


@pytest.mark.parametrize("guidance", [1.0, 4.5])  # no CFG / two-pass CFG (Flow-GRPO's 4.5)
@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_ode_trajectory_equals_sd3_pipeline(tiny_cfg, size, guidance):
    h, w = size
    cfg = tiny_cfg(*SD3, f"model.height={h}", f"model.width={w}", f"sampling.guidance={guidance}")
    ad, noise, ours, theirs, images = run_both(cfg)
    assert ours.shape[2:] == (4, h // 4, w // 4)  # spatial latents: the tiny VAE compresses 4x
    assert theirs.shape == ours[:, 1:].shape
    assert torch.allclose(ours[:, 1:], theirs, atol=1e-5, rtol=1e-5), (ours[:, 1:] - theirs).abs().max()
    assert (ours[:, -1] - noise).abs().mean() > 1e-2  # not vacuous: the trajectory moved
    # the real-VAE decode (scaling factor, shift factor) equals the pipeline's decoded output
    ad.preview = None
    assert torch.allclose(ad.decode(ours[:, -1]), images, atol=1e-5)


def test_guidance_is_the_cfg_combination_of_the_two_passes(tiny_cfg):
    cfg = tiny_cfg(*SD3, "sampling.guidance=4.5")
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a green frog"])
    x = ad.initial_noise(1, torch.Generator().manual_seed(0))
    sig = torch.tensor([0.7])
    v = ad.velocity(x, sig, cond)
    with torch.no_grad():  # by hand: the transformer on each prompt, timestep 1000 sigma
        t = torch.tensor([700.0])
        kw = dict(hidden_states=x, timestep=t, return_dict=False)
        v_c = ad.transformer(
            encoder_hidden_states=cond.batched["prompt_embeds"],
            pooled_projections=cond.batched["pooled"],
            **kw,
        )[0]
        v_u = ad.transformer(
            encoder_hidden_states=cond.batched["neg_prompt_embeds"],
            pooled_projections=cond.batched["neg_pooled"],
            **kw,
        )[0]
    assert not torch.allclose(v_c, v_u)
    assert torch.allclose(v, v_u + 4.5 * (v_c - v_u), atol=1e-6)


def test_sigmas_are_the_checkpoints_fixed_shift(tiny_cfg):
    cfg = tiny_cfg(*SD3)
    ad = build_adapter(cfg.model, cfg.sampling)
    s = ad.sigmas(4)
    shift = lambda u: 3 * u / (1 + 2 * u)  # noqa: E731  (shift 3)
    # FlowMatchEulerDiscreteScheduler: linspace from 1 to its smallest training sigma (shift(1/1000)),
    # then shifted again
    u = torch.linspace(1.0, shift(torch.tensor(1e-3)).item(), 4)
    assert torch.allclose(s[:-1], shift(u), atol=1e-6) and s[-1] == 0


def test_gradient_flows_through_both_cfg_passes(tiny_cfg):
    cfg = tiny_cfg(*SD3, "sampling.guidance=4.5")
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a green frog"])
    x = ad.initial_noise(1, torch.Generator().manual_seed(0))
    ad.velocity(x, torch.tensor([0.5]), cond).square().mean().backward()
    w = ad.transformer.transformer_blocks[0].attn.add_q_proj.weight  # text stream: differs per pass
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_lora_targets_are_flow_grpos_and_all_exist(tiny_cfg):
    from digenrl.policy.lora import matching_modules

    cfg = tiny_cfg(*SD3)
    ad = build_adapter(cfg.model, cfg.sampling)
    for target in ad.default_lora_targets:
        assert matching_modules(ad.transformer, target), target
    # the MMDiT-X second attention is not a target (Flow-GRPO trains the joint attention only)
    assert not any(
        ".attn2." in n for t in ad.default_lora_targets for n in matching_modules(ad.transformer, t)
    )


@pytest.mark.parametrize(
    "override,field", [("model.height=36", "model.height"), ("model.frames=1", "model.frames")]
)
def test_bad_shape_is_a_user_error(tiny_cfg, override, field):
    cfg = tiny_cfg(*SD3, override)
    with pytest.raises(UserError, match=field):
        build_adapter(cfg.model, cfg.sampling)


def test_missing_or_invalid_checkpoint_dir(tiny_cfg, tmp_path):
    cfg = tiny_cfg(*SD3, f"model.pretrained={tmp_path / 'nope'}")
    with pytest.raises(UserError, match="not found"):
        build_adapter(cfg.model, cfg.sampling)
    cfg = tiny_cfg(*SD3, f"model.pretrained={tmp_path}")  # exists, but no model_index.json
    with pytest.raises(UserError, match=re.escape(str(tmp_path))):
        build_adapter(cfg.model, cfg.sampling)


def test_pretrained_directory_loads_through_the_pipeline(tiny_cfg, tmp_path):
    """A saved StableDiffusion3Pipeline directory (the tiny components, no text encoders) loads as
    ``model.pretrained`` with the same transformer weights and the checkpoint's own scheduler."""
    from diffusers import StableDiffusion3Pipeline

    cfg = tiny_cfg(*SD3, "model.height=32", "model.width=32")
    tiny = build_adapter(cfg.model, cfg.sampling)
    parts = dict.fromkeys(
        ["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3"]
    )
    StableDiffusion3Pipeline(
        transformer=tiny.transformer, vae=tiny.vae, scheduler=tiny.scheduler, **parts
    ).save_pretrained(tmp_path / "sd3")
    cfg = tiny_cfg(*SD3, "model.height=32", "model.width=32", f"model.pretrained={tmp_path / 'sd3'}")
    ad = build_adapter(cfg.model, cfg.sampling)
    assert ad.scheduler.config.shift == 3.0 and ad.vae.config.shift_factor == pytest.approx(0.0609)
    a, b = tiny.transformer.state_dict(), ad.transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(ad.sigmas(6), tiny.sigmas(6))


def test_tiny_config_file_loads():
    from digenrl.config.run import load_config

    cfg = load_config(Path(__file__).parents[1] / "configs" / "sd3_tiny.yaml")
    assert cfg.model.adapter == "sd3" and cfg.sampling.guidance > 1


@pytest.fixture(scope="module")
def sd3_checkpoint(tmp_path_factory):
    """A tiny SD3 checkpoint in the real layout -- CLIP-L, CLIP-G (with projections) and T5 encoders
    with word-level tokenizers, the tiny transformer and VAE -- saved with save_pretrained."""
    from diffusers import StableDiffusion3Pipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        PreTrainedTokenizerFast,
        T5Config,
        T5EncoderModel,
    )

    from digenrl.config.run import load_config

    words = ["<pad>", "</s>", "<unk>", "a", "red", "apple", "blue", "sky", "on", "table"]

    def tokenizer(max_len):
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            pad_token="<pad>",
            eos_token="</s>",
            unk_token="<unk>",
            model_max_length=max_len,
        )

    def clip(width):  # hidden widths 4 + 8 = 12 <= T5's 16; projections 8 + 8 = the pooled 16
        cfg = CLIPTextConfig(
            vocab_size=len(words),
            hidden_size=width,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            projection_dim=8,
            eos_token_id=2,
        )
        return CLIPTextModelWithProjection(cfg)

    cfg = load_config(None, [*SD3, "model.height=32", "model.width=32"])
    tiny = build_adapter(cfg.model, cfg.sampling)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        encoders = dict(
            text_encoder=clip(4),
            text_encoder_2=clip(8),
            text_encoder_3=T5EncoderModel(
                T5Config(vocab_size=len(words), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
            ),
        )
    path = tmp_path_factory.mktemp("sd3_ckpt")
    StableDiffusion3Pipeline(
        transformer=tiny.transformer,
        vae=tiny.vae,
        scheduler=tiny.scheduler,
        tokenizer=tokenizer(77),
        tokenizer_2=tokenizer(77),
        tokenizer_3=tokenizer(512),
        **encoders,
    ).save_pretrained(path)
    return path


@pytest.mark.slow
def test_checkpoint_with_three_text_encoders_equals_the_pipeline_from_prompts(tiny_cfg, sd3_checkpoint):
    """From a checkpoint directory the adapter encodes with the pipeline's own three encoders: the
    trajectory equals StableDiffusion3Pipeline.from_pretrained given the prompt strings themselves
    (it tokenizes and encodes prompt and negative prompt on its own)."""
    from diffusers import StableDiffusion3Pipeline

    cfg = tiny_cfg(
        *SD3,
        "model.height=32",
        "model.width=32",
        "model.max_text_len=8",
        "sampling.guidance=4.5",
        f"model.pretrained={sd3_checkpoint}",
    )
    ad = build_adapter(cfg.model, cfg.sampling)
    prompts = ["a red apple on a table", "a blue sky"]
    cond = ad.cond_for(prompts)
    assert cond.batched["prompt_embeds"].shape == (2, 77 + 8, 16) and cond.batched["pooled"].shape == (2, 16)
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = sample(ad, cond, noise, ad.sigmas(4), "flow_grpo", 0.0, None).latents[:, -1]
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_checkpoint)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        prompt=prompts,
        negative_prompt="",
        guidance_scale=4.5,
        latents=noise.clone(),
        num_inference_steps=4,
        height=32,
        width=32,
        max_sequence_length=8,
        output_type="latent",
    ).images
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    assert (ours - noise).abs().mean() > 1e-2
