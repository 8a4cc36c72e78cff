"""FLUX.2 adapter: the sampler with noise level 0 reproduces diffusers' own Flux2KleinPipeline ([klein]:
two-pass CFG) and Flux2Pipeline ([dev]: embedded guidance)."""

import inspect
from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.errors import UserError

F2 = ("model.adapter=flux2", "model.lora.targets=null")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "flux2_tiny.yaml"


def pipeline_of(ad):
    import diffusers

    cls = getattr(diffusers, ad.pipeline_class)
    parts = {
        "transformer": ad.transformer,
        "vae": ad.vae,
        "scheduler": ad.flow_scheduler(dict(ad.scheduler.config)),
    }
    names = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "is_distilled")]
    pipe = cls(**{n: parts.get(n) for n in names})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_kwargs(ad, cond) -> dict:
    """The prompt's embeddings (and the negative prompt's where [klein] runs CFG)."""
    b = cond.batched
    negative = {"negative_prompt_embeds": b["neg_prompt_embeds"]} if ad.uses_cfg() else {}
    return {"prompt_embeds": b["prompt_embeds"], **negative}


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
        latents=ad.to_spatial(noise),  # the pipeline packs (B, 4C, rows, cols) itself
        num_inference_steps=steps,
        height=cfg.model.height,
        width=cfg.model.width,
        output_type="pt",
        callback_on_step_end=lambda p, i, t, kw: seen.append(kw["latents"].clone()) or {},
    ).images
    return ad, noise, ours, torch.stack(seen, 1), images


@pytest.mark.parametrize(
    "preset,guidance", [("tiny", 1.0), ("tiny", 4.0), ("tiny_dev", 2.5), ("tiny_dev", 4.0)]
)  # [klein] without / with CFG; [dev]'s embedded guidance at two scales
@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_ode_trajectory_equals_flux2_pipeline(tiny_cfg, size, preset, guidance):
    h, w = size
    cfg = tiny_cfg(
        *F2,
        f"model.preset={preset}",
        f"model.height={h}",
        f"model.width={w}",
        f"sampling.guidance={guidance}",
    )
    ad, noise, ours, theirs, images = run_both(cfg)
    assert ours.shape[2:] == ((h // 4) * (w // 4), 16)  # 2x VAE, then 2x2 patches of 4 channels
    assert theirs.shape == ours[:, 1:].shape
    assert torch.allclose(ours[:, 1:], theirs, atol=1e-5, rtol=1e-5), (ours[:, 1:] - theirs).abs().max()
    assert (ours[:, -1] - noise).abs().mean() > 1e-2  # not vacuous: the trajectory moved
    ad.preview = None  # the real-VAE decode (batch-norm statistics, un-patchify) equals the pipeline's
    assert torch.allclose(ad.decode(ours[:, -1]), images, atol=1e-5)


def test_guidance_changes_the_velocity_in_each_variant(tiny_cfg):
    for preset, passes in (("tiny", 2), ("tiny_dev", 1)):
        cfg = tiny_cfg(*F2, f"model.preset={preset}", "sampling.guidance=4.0")
        ad = build_adapter(cfg.model, cfg.sampling)
        cond = ad.encode_prompts(["a green frog"])
        x = ad.initial_noise(1, torch.Generator().manual_seed(0))
        calls = []
        hook = ad.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
        v = ad.velocity(x, torch.tensor([0.7]), cond)
        hook.remove()
        assert len(calls) == passes, preset
        ad.sampling.guidance = 1.0
        assert not torch.allclose(v, ad.velocity(x, torch.tensor([0.7]), cond)), preset


def test_a_step_distilled_klein_never_runs_cfg(tiny_cfg):
    cfg = tiny_cfg(*F2, "sampling.guidance=4.0")
    ad = build_adapter(cfg.model, cfg.sampling)
    assert ad.uses_cfg()
    ad.is_distilled = True  # Flux2KleinPipeline(is_distilled=True): do_classifier_free_guidance is False
    assert not ad.uses_cfg() and "neg_prompt_embeds" not in ad.encode_prompts(["a cat"]).batched


def test_text_encoders_are_real_lms_and_three_layers_are_stacked(tiny_cfg):
    from transformers import MistralModel, Qwen3Model

    for preset, cls in (("tiny", Qwen3Model), ("tiny_dev", MistralModel)):
        cfg = tiny_cfg(*F2, f"model.preset={preset}")
        ad = build_adapter(cfg.model, cfg.sampling)
        assert isinstance(ad.text.model, cls)
        states, _ = ad.text.hidden_states(["a red apple"])
        e = ad.encode_prompts(["a red apple"]).batched["prompt_embeds"]
        assert e.shape == (1, cfg.model.max_text_len, ad.transformer.config.joint_attention_dim)
        assert torch.equal(e[0, :, 16:32], states[2][0])  # per token: layer 1, layer 2, layer 3


@pytest.mark.parametrize("preset", ["tiny", "tiny_dev"])
def test_tiny_prompt_moves_the_velocity(preset):
    """The shipped tiny FLUX.2 hears its prompt about as loudly as Z-Image's tiny preset: "red" vs "blue"
    moves the velocity by >= 15% of its norm (Z-Image 6-25% over init seeds; the 1 + 1 block preset with
    16 text tokens 6%, torch's default init 0.1%: gates ~0.05, padded text positions blind to the prompt)."""
    from digenrl.config.run import load_config

    cfg = load_config(CONFIG, [f"model.preset={preset}"])
    ad = build_adapter(cfg.model, cfg.sampling)
    acts = {}
    ad.transformer.double_stream_modulation_img.register_forward_hook(lambda m, i, o: acts.update(mod=o))
    cond = ad.encode_prompts(["a red apple", "a blue apple"])
    noise = ad.initial_noise(1, torch.Generator().manual_seed(3)).expand(2, -1, -1)
    with torch.no_grad():
        v = ad.velocity(noise, torch.full((2,), 0.5), cond)
    assert (v[0] - v[1]).norm() > 0.15 * v[0].norm()
    gate = acts["mod"].chunk(6, dim=-1)[2]  # shift, scale, gate of the attention
    assert 0.1 < gate.abs().mean() < 1.0
    pads = cond.batched["prompt_embeds"][:, 4:]  # the padded positions after the 3 words
    assert (pads[0] - pads[1]).abs().mean() > 0.1 * pads.abs().mean()


def test_tiny_preset_keeps_the_published_proportions(tiny_cfg):
    """The stacked layers sit where the pipelines take them in their LMs' depth ((9, 18, 27) of Qwen3-4B's
    36, (10, 20, 30) of Mistral-Small-3.1's 40), the blocks keep [klein] 4B's double : single ratio, and
    the shipped config's text is half its image tokens (512 padded tokens beside 1024 at 512 px)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    from digenrl.adapters.flux2 import FLUX2_KLEIN_4B
    from digenrl.config.run import load_config

    for preset, getter, depth in (
        ("tiny", Flux2KleinPipeline._get_qwen3_prompt_embeds, 36),
        ("tiny_dev", Flux2Pipeline._get_mistral_3_small_prompt_embeds, 40),
    ):
        ad = build_adapter(tiny_cfg(*F2, f"model.preset={preset}").model, tiny_cfg(*F2).sampling)
        layers = inspect.signature(getter).parameters["hidden_states_layers"].default
        tiny_depth = ad.text.model.config.num_hidden_layers
        assert [k / tiny_depth for k in ad.text_layers] == [k / depth for k in layers]
        c, published = ad.transformer.config, FLUX2_KLEIN_4B.transformer
        assert c.num_single_layers / c.num_layers == published["num_single_layers"] / published["num_layers"]
    cfg = load_config(CONFIG)
    assert cfg.model.max_text_len == 512 * (cfg.model.height // 4) * (cfg.model.width // 4) // 1024


def test_lora_targets_all_exist(tiny_cfg):
    ad = build_adapter(tiny_cfg(*F2).model, tiny_cfg(*F2).sampling)
    names = [n for n, m in ad.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in ad.default_lora_targets:
        assert any(n.endswith("." + target) for n in names), target


@pytest.mark.parametrize(
    "override,field", [("model.height=18", "model.height"), ("model.frames=3", "model.frames")]
)
def test_bad_shape_is_a_user_error(tiny_cfg, override, field):
    cfg = tiny_cfg(*F2, override)
    with pytest.raises(UserError, match=field):
        build_adapter(cfg.model, cfg.sampling)
