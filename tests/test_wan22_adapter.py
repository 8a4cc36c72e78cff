"""Wan2.2 adapter: the sampler with noise level 0 reproduces diffusers' own WanPipeline -- T2V-A14B
with its two experts switched at the boundary, and TI2V-5B (48-channel VAE, per-token timesteps)."""

import re
from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.config.run import load_config
from digenrl.errors import UserError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = {"a14b": CONFIGS / "wan2.2_tiny.yaml", "ti2v_5b": CONFIGS / "wan2.2_ti2v_tiny.yaml"}


def wan22_cfg(variant: str, *overrides: str):
    return load_config(TINY[variant], ["model.lora=null", *overrides])


def build(cfg):
    return build_adapter(cfg.model, cfg.sampling)


def pipeline_for(ad):
    """diffusers' WanPipeline over the adapter's own modules (no text encoder: prompt embeddings in)."""
    from diffusers import WanPipeline

    experts = ad.transformer.experts() if ad.two_experts else [ad.transformer, None]
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=ad.vae,
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=ad.boundary_ratio,
        expand_timesteps=ad.expand_timesteps,
        scheduler=ad.flow_scheduler({"shift": ad.sampling.shift}),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(ad, cond, noise, steps, **kw):
    m, s = ad.cfg, ad.sampling
    if s.guidance > 1:
        kw["negative_prompt_embeds"] = cond.batched["neg_prompt_embeds"]
    if ad.two_experts and s.guidance_2 is not None:
        kw["guidance_scale_2"] = s.guidance_2
    return pipeline_for(ad)(
        prompt_embeds=cond.batched["prompt_embeds"],
        latents=noise.clone(),
        num_inference_steps=steps,
        guidance_scale=s.guidance,
        height=m.height,
        width=m.width,
        num_frames=m.frames,
        **kw,
    ).frames


@pytest.mark.parametrize("guidance", ["1.0", "4.0"])  # no CFG / two-pass CFG (A14B: 4.0 high, 3.0 low)
@pytest.mark.parametrize("size", [(32, 32, 5), (32, 48, 9)])
@pytest.mark.parametrize("variant", ["a14b", "ti2v_5b"])
def test_ode_trajectory_equals_wan_pipeline(variant, size, guidance):
    h, w, f = size
    cfg = wan22_cfg(
        variant, f"model.height={h}", f"model.width={w}", f"model.frames={f}", f"sampling.guidance={guidance}"
    )
    ad = build_adapter(cfg.model, cfg.sampling)
    assert ad.two_experts == (variant == "a14b") and ad.expand_timesteps == (variant == "ti2v_5b")
    cond = ad.encode_prompts(["a red apple", "a blue sky"])
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    steps = 6
    calls = {}  # forwards per expert: the boundary is crossed (steps on both sides)
    nets = ad.transformer.experts() if ad.two_experts else [ad.transformer]
    hooks = [
        n.register_forward_pre_hook(lambda m, *_: calls.__setitem__(m, calls.get(m, 0) + 1)) for n in nets
    ]
    ours = sample(ad, cond, noise, ad.sigmas(steps), "flow_grpo", 0.0, None).latents[:, -1]
    for hook in hooks:
        hook.remove()
    theirs = run_pipeline(ad, cond, noise, steps, output_type="latent")
    latent_c = 4 if variant == "a14b" else 48
    assert ours.shape == theirs.shape == (2, latent_c, (f - 1) // 4 + 1, *ad.latent_shape()[2:])
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()
    assert (ours - noise).abs().mean() > 1e-2  # not vacuous: the trajectory moved
    passes = 2 if float(guidance) > 1 else 1
    if variant == "a14b":  # shift 3, 6 steps: t = 1000, 923 at or above 875; 818 ... below
        assert [calls.get(n, 0) for n in nets] == [2 * passes, 4 * passes]
    else:
        assert calls[nets[0]] == 6 * passes
    # the real-VAE decode (the Wan2.2 VAE's 48 channels for TI2V) equals the pipeline's decoded video
    ad.preview = None
    video = run_pipeline(ad, cond, noise, steps, output_type="pt")
    assert torch.allclose(ad.decode(ours).transpose(1, 2), video, atol=1e-5)


def test_each_expert_has_its_own_guidance_scale():
    """guidance_2 changes the low-noise steps only: the same high-noise velocity, another trajectory."""
    ad = build(wan22_cfg("a14b"))
    cond = ad.encode_prompts(["a green frog"])
    x = ad.initial_noise(1, torch.Generator().manual_seed(0))
    high, low = torch.tensor([0.95]), torch.tensor([0.5])
    v_high, v_low = ad.velocity(x, high, cond), ad.velocity(x, low, cond)
    ad.sampling = ad.sampling.model_copy(update={"guidance_2": None})  # = guidance, as the pipeline
    assert torch.equal(ad.velocity(x, high, cond), v_high)
    assert (ad.velocity(x, low, cond) - v_low).abs().max() > 1e-4
    with torch.no_grad():  # by hand: the low-noise expert on each prompt at t = 500, guidance 3.0
        kw = dict(hidden_states=x, timestep=torch.tensor([500.0]), return_dict=False)
        v_c = ad.transformer.transformer_2(encoder_hidden_states=cond.batched["prompt_embeds"], **kw)[0]
        v_u = ad.transformer.transformer_2(encoder_hidden_states=cond.batched["neg_prompt_embeds"], **kw)[0]
    assert torch.allclose(v_low, v_u + 3.0 * (v_c - v_u), atol=1e-6)


def test_a_batch_across_the_boundary_runs_each_row_on_its_expert():
    """Training may batch steps of both sides: each row equals its own step computed alone, and
    gradients reach both experts (sequential CFG: the same path through the backward)."""
    from digenrl.adapters.guidance import backward_through_velocity

    cfg = wan22_cfg("a14b", "sampling.cfg_batching=sequential")
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a red apple", "a blue sky"])
    x = ad.initial_noise(2, torch.Generator().manual_seed(1))
    sig = torch.tensor([0.95, 0.5])
    v = ad.velocity(x, sig, cond)
    for i in range(2):
        alone = ad.velocity(x[i : i + 1], sig[i : i + 1], cond.select(slice(i, i + 1)))
        assert torch.allclose(v[i : i + 1], alone, atol=1e-5)
    backward_through_velocity(ad, x, sig, cond, lambda v: (v.square().mean(), None))
    for expert in ad.transformer.experts():
        assert expert.blocks[0].attn1.to_q.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("cfg_batching", ["sequential", "batched"])
def test_a_frozen_experts_steps_backpropagate_nothing(cfg_batching):
    """model.train_experts=low_noise: a batch of high-noise steps reaches no trained weight (no error,
    no gradient); a batch across the boundary trains the low-noise expert only."""
    from digenrl.adapters.guidance import backward_through_velocity

    cfg = wan22_cfg("a14b", "model.train_experts=low_noise", f"sampling.cfg_batching={cfg_batching}")
    ad = build(cfg)
    cond = ad.encode_prompts(["a red apple", "a blue sky"])
    x = ad.initial_noise(2, torch.Generator().manual_seed(1))
    high, low = ad.transformer.experts()
    objective = lambda v: (v.square().mean(), None)  # noqa: E731
    backward_through_velocity(ad, x, torch.tensor([0.95, 0.9]), cond, objective)
    assert all(p.grad is None for p in ad.transformer.parameters())
    backward_through_velocity(ad, x, torch.tensor([0.95, 0.5]), cond, objective)
    assert all(p.grad is None for p in high.parameters())
    assert low.blocks[0].attn1.to_q.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("train_experts, trained", [("both", [1, 1]), ("low_noise", [0, 1])])
def test_lora_on_the_trained_experts_only(train_experts, trained):
    from digenrl.policy.lora import apply_lora, lora_state_dict

    cfg = load_config(TINY["a14b"], [f"model.train_experts={train_experts}"])
    ad = build_adapter(cfg.model, cfg.sampling)
    apply_lora(ad.transformer, cfg.model.lora, ad.default_lora_targets)
    for expert, on in zip(ad.transformer.experts(), trained):
        trainable = [n for n, p in expert.named_parameters() if p.requires_grad]
        assert bool(trainable) == bool(on) and all("lora_" in n for n in trainable)
    keys = lora_state_dict(ad.transformer)
    assert {k.split(".")[0] for k in keys} == {
        n for n, on in zip(("transformer", "transformer_2"), trained) if on
    }
    # full fine-tuning: the frozen expert gets no gradient either
    full = build(wan22_cfg("a14b", f"model.train_experts={train_experts}"))
    full.transformer.requires_grad_(True)
    for expert, on in zip(full.transformer.experts(), trained):
        assert all(p.requires_grad == bool(on) for p in expert.parameters())


def test_default_lora_targets_exist_in_both_experts():
    from digenrl.policy.lora import matching_modules

    ad = build(wan22_cfg("a14b"))
    for target in ad.default_lora_targets:
        for expert in ad.transformer.experts():
            assert matching_modules(expert, target), target


@pytest.mark.parametrize(
    "variant, override, field",
    [
        ("a14b", "model.frames=6", "model.frames"),
        ("ti2v_5b", "model.height=40", "model.height"),  # the TI2V VAE x8 and patch 2: multiples of 16
        ("a14b", "model.preset=huge", "model.preset"),
    ],
)
def test_bad_input_is_a_user_error(variant, override, field):
    cfg = wan22_cfg(variant, override)
    with pytest.raises(UserError, match=re.escape(field)):
        build_adapter(cfg.model, cfg.sampling)


def test_missing_checkpoint(tmp_path):
    cfg = wan22_cfg("a14b", f"model.pretrained={tmp_path / 'nope'}", "model.preset=null")
    with pytest.raises(UserError, match="not found"):
        build_adapter(cfg.model, cfg.sampling)


@pytest.mark.parametrize("variant", ["a14b", "ti2v_5b"])
def test_pretrained_directory_loads_both_experts_and_the_flags(variant, tmp_path):
    """A saved WanPipeline directory (boundary_ratio / expand_timesteps in its model_index.json)
    loads as model.pretrained -- the whole pipeline, and a trainer rank's transformer(s) alone."""
    cfg = wan22_cfg(variant)
    tiny = build_adapter(cfg.model, cfg.sampling)
    pipeline_for(tiny).save_pretrained(tmp_path / "ckpt")
    for generates in (True, False):
        cfg = wan22_cfg(variant, f"model.pretrained={tmp_path / 'ckpt'}", "model.preset=null")
        ad = build_adapter(cfg.model, cfg.sampling, generates=generates)
        assert (ad.two_experts, ad.boundary_ratio, ad.expand_timesteps) == (
            tiny.two_experts,
            tiny.boundary_ratio,
            tiny.expand_timesteps,
        )
        a, b = tiny.transformer.state_dict(), ad.transformer.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
