"""Timesteps and guidance reach each transformer in the dtype and value its diffusers pipeline passes,
at bf16 (issue 53, item 3). The real pipeline, over the adapter's own modules, runs a 28-step schedule
with bf16 prompt embeddings (what its bf16 text encoders give); the adapter samples the same schedule
with ``model.dtype=bfloat16``. A forward pre-hook on each transformer records the ``timestep`` and
``guidance`` it is called with: the two sequences are equal, dtype and bits. On 8f4fead SD3 passed a
bf16 timestep where its pipeline passes fp32, and FLUX / Kontext / Qwen-Image / Qwen-Image-Edit
rounded ``sigma`` to bf16 after dividing by 1000 where their pipelines round ``1000 sigma`` first.

A new family is one line of ``FAMILIES``: its tiny config, overrides, and the pipeline call."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.config.run import load_config
from tests.helpers import TINY_IMAGE

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STEPS = 28  # the pipelines' default schedule length (FLUX: 9 of its 28 timesteps differed by one ulp)
BF16 = torch.bfloat16


def _pipe(ad, name: str, **parts):
    import diffusers

    net = ad.transformer.transformer if getattr(ad, "two_experts", False) else ad.transformer
    pipe = getattr(diffusers, name)(transformer=net, vae=ad.vae, **parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _bf16(cond, *keys) -> dict:
    """The conditioning tensors as a bf16 pipeline's text encoders give them (masks stay integer)."""
    b = cond.batched
    return {k: (b[k].to(BF16) if b[k].is_floating_point() else b[k]) for k in keys if k in b}


def run_flux(ad, cond, noise, **_):
    b = _bf16(cond, "prompt_embeds", "pooled")
    none = dict.fromkeys(["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"])
    pipe = _pipe(ad, "FluxPipeline", scheduler=ad.flow_scheduler(dict(ad.scheduler.config)), **none)
    pipe(
        prompt_embeds=b["prompt_embeds"],
        pooled_prompt_embeds=b["pooled"],
        guidance_scale=ad.sampling.guidance,
        **_common(ad, noise),
    )


def run_sd3(ad, cond, noise, **_):
    b = _bf16(cond, "prompt_embeds", "pooled", "neg_prompt_embeds", "neg_pooled")
    none = dict.fromkeys([f"{p}{s}" for p in ("text_encoder", "tokenizer") for s in ("", "_2", "_3")])
    pipe = _pipe(
        ad, "StableDiffusion3Pipeline", scheduler=ad.flow_scheduler(dict(ad.scheduler.config)), **none
    )
    pipe(
        prompt_embeds=b["prompt_embeds"],
        pooled_prompt_embeds=b["pooled"],
        negative_prompt_embeds=b.get("neg_prompt_embeds"),
        negative_pooled_prompt_embeds=b.get("neg_pooled"),
        guidance_scale=ad.sampling.guidance,
        **_common(ad, noise),
    )


def run_qwen(ad, cond, noise, **_):
    b = _bf16(cond, "prompt_embeds", "mask", "neg_prompt_embeds", "neg_mask")
    pipe = _pipe(
        ad,
        "QwenImagePipeline",
        scheduler=ad.flow_scheduler(dict(ad.scheduler.config)),
        text_encoder=None,
        tokenizer=None,
    )
    pipe(
        prompt_embeds=b["prompt_embeds"],
        prompt_embeds_mask=b["mask"],
        negative_prompt_embeds=b.get("neg_prompt_embeds"),
        negative_prompt_embeds_mask=b.get("neg_mask"),
        true_cfg_scale=ad.sampling.guidance,
        **_common(ad, noise),
    )


def run_wan(ad, cond, noise, **_):
    b = _bf16(cond, "prompt_embeds", "neg_prompt_embeds")
    sched = ad.flow_scheduler({"shift": ad.sampling.shift or ad.scheduler.config.shift})
    kw, parts = {}, {"expand_timesteps": getattr(ad, "expand_timesteps", False)}  # TI2V: per token
    if getattr(ad, "two_experts", False):  # Wan2.2 A14B: both experts, switched at the boundary
        parts.update(transformer_2=ad.transformer.transformer_2, boundary_ratio=ad.boundary_ratio)
        kw["guidance_scale_2"] = ad.sampling.guidance_2
    pipe = _pipe(ad, "WanPipeline", scheduler=sched, tokenizer=None, text_encoder=None, **parts)
    pipe(
        prompt_embeds=b["prompt_embeds"],
        negative_prompt_embeds=b.get("neg_prompt_embeds"),
        guidance_scale=ad.sampling.guidance,
        num_frames=ad.cfg.frames,
        **kw,
        **_common(ad, noise),
    )


def run_hunyuan(ad, cond, noise, **_):
    b = _bf16(cond, "prompt_embeds", "pooled", "mask")
    sched = ad.flow_scheduler({**dict(ad.scheduler.config), "shift": ad.sampling.shift or 7.0})
    none = dict.fromkeys(["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"])
    pipe = _pipe(ad, "HunyuanVideoPipeline", scheduler=sched, **none)
    pipe(
        prompt_embeds=b["prompt_embeds"],
        pooled_prompt_embeds=b["pooled"],
        prompt_attention_mask=b["mask"],
        guidance_scale=ad.sampling.guidance,
        num_frames=ad.cfg.frames,
        **_common(ad, noise),
    )


def run_edit(ad, cond, noise, images, monkeypatch, **_):
    """Kontext / Qwen-Image-Edit: one sample per call (the pipeline resizes one input image)."""
    from tests.test_edit_adapters import edit_pipeline, run_pipeline

    cond.batched.update(_bf16(cond, "prompt_embeds", "pooled", "neg_prompt_embeds"))
    pipe = edit_pipeline(ad.name, ad, monkeypatch)
    cfg = load_config(None, [f"model.height={ad.cfg.height}", f"model.width={ad.cfg.width}"])
    cfg = cfg.model_copy(update={"sampling": ad.sampling})
    run_pipeline(pipe, ad.name, cfg, cond, noise, images, STEPS, 0, output_type="latent")


def run_z_image(ad, cond, noise, **_):
    from tests.test_z_image_adapter import pipeline_of, prompt_kwargs

    cond.batched.update(_bf16(cond, "prompt_embeds", "neg_prompt_embeds"))
    pipe = pipeline_of(ad)
    pipe(**prompt_kwargs(ad, cond), guidance_scale=ad.sampling.guidance, **_common(ad, noise))


def run_flux2(ad, cond, noise, **_):
    """[klein] (Flux2KleinPipeline) or [dev] (Flux2Pipeline), as the adapter's transformer says."""
    from tests.test_flux2_adapter import pipeline_of, prompt_kwargs

    cond.batched.update(_bf16(cond, "prompt_embeds", "neg_prompt_embeds"))
    spatial = {**_common(ad, noise), "latents": ad.to_spatial(noise)}  # the pipeline packs them itself
    pipeline_of(ad)(**prompt_kwargs(ad, cond), guidance_scale=ad.sampling.guidance, **spatial)


def run_hunyuan15(ad, cond, noise, **_):
    from tests.test_hunyuan_video15_adapter import pipeline_of, prompt_kwargs

    cond.batched.update(
        _bf16(cond, "prompt_embeds", "prompt_embeds_2", "neg_prompt_embeds", "neg_prompt_embeds_2")
    )
    pipeline_of(ad)(**prompt_kwargs(ad, cond), num_frames=ad.cfg.frames, **_common(ad, noise))


def run_hunyuan15_i2v(ad, cond, noise, images, **_):
    """Image to video: one sample per call (the pipeline takes one first frame)."""
    from tests.test_hunyuan_video15_i2v_adapter import i2v_pipeline, run_pipeline

    cond.batched.update(
        _bf16(cond, "prompt_embeds", "prompt_embeds_2", "neg_prompt_embeds", "neg_prompt_embeds_2")
    )
    run_pipeline(i2v_pipeline(ad), ad, cond, noise, images[0], ad.cfg.frames, STEPS, 0, output_type="latent")


def _common(ad, noise) -> dict:
    m = ad.cfg
    return dict(
        latents=noise.clone(), num_inference_steps=STEPS, height=m.height, width=m.width, output_type="latent"
    )


#: FLUX.2 at its pipeline's empirical shift (its tiny config fixes the scheduler config's 3.0)
EMPIRICAL = ("sampling.shift=null",)

#: family -> (tiny config, overrides, the pipeline's call over the adapter's modules)
FAMILIES = {
    "flux": ("flux_tiny.yaml", TINY_IMAGE, run_flux),
    "flux_kontext": ("flux_kontext_tiny.yaml", [], run_edit),
    "sd3": ("sd3_tiny.yaml", ["sampling.cfg_batching=batched"], run_sd3),  # its pipeline batches CFG
    "qwen_image": ("qwen_tiny.yaml", [], run_qwen),
    "qwen_image_edit": ("qwen_image_edit_tiny.yaml", [], run_edit),
    "wan": ("wan_tiny.yaml", ["model.frames=1"], run_wan),
    "wan22": ("wan2.2_tiny.yaml", [], run_wan),
    "wan22_ti2v": ("wan2.2_ti2v_tiny.yaml", ["model.frames=1"], run_wan),
    "hunyuan_video": ("hunyuan_tiny.yaml", ["model.frames=1"], run_hunyuan),
    "z_image": ("z_image_tiny.yaml", [], run_z_image),
    "flux2": ("flux2_tiny.yaml", [*EMPIRICAL], run_flux2),  # [klein]
    "flux2_dev": ("flux2_tiny.yaml", [*EMPIRICAL, "model.preset=tiny_dev", "sampling.guidance=4"], run_flux2),
    "hunyuan_video15": ("hunyuan_video15_tiny.yaml", [], run_hunyuan15),
    "hunyuan_video15_i2v": ("hunyuan_video15_i2v_tiny.yaml", [], run_hunyuan15_i2v),
}


def _record(ad, calls: list):
    """Forward pre-hooks on each transformer (both experts of a Wan2.2 A14B): (expert, timestep,
    guidance) of each call, the first row's (a pipeline of an edit family runs one sample)."""
    nets = ad.transformer.experts() if getattr(ad, "two_experts", False) else [ad.transformer]

    def hook(module, args, kwargs):
        named = {**dict(zip(inspect.signature(module.forward).parameters, args)), **kwargs}
        named.setdefault("timestep", named.get("t"))  # Z-Image: forward(x, t, cap_feats), positional
        row = {}
        for key in ("timestep", "guidance"):
            value = named.get(key)
            if value is not None:
                assert (value == value[:1]).all(), f"{key}: rows of one call differ"
                row[key] = value[0].detach().clone()
        calls.append((nets.index(module), row))

    return [net.register_forward_pre_hook(hook, with_kwargs=True) for net in nets]


def timestep_calls(family: str, tmp_path, monkeypatch, device="cpu") -> tuple[list, list]:
    """(the adapter's, the pipeline's) transformer calls over the family's 28-step schedule at bf16, on
    ``device`` (benchmarks/gpu_ready.py runs it on a GPU)."""
    from tests.test_edit_adapters import PROMPTS, edit_images

    path, sets, run = FAMILIES[family]
    cfg = load_config(CONFIGS / path, [*sets, "model.dtype=bfloat16", "model.lora=null"])
    ad = build_adapter(cfg.model, cfg.sampling, device)
    ad.transformer.to(BF16)  # a bf16 checkpoint's weights, as both sides hold them
    ad.vae.to(BF16)
    images = edit_images(tmp_path, cfg.model.height, cfg.model.width) if ad.edits else None
    cond = ad.cond_for(PROMPTS, images)
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours, theirs = [], []
    hooks = _record(ad, ours)
    with torch.no_grad():
        sample(ad, cond, noise, ad.sigmas(STEPS), "flow_grpo", 0.0, None)
    for h in hooks:
        h.remove()
    hooks = _record(ad, theirs)
    run(ad, cond, noise, images=images, monkeypatch=monkeypatch)
    for h in hooks:
        h.remove()
    return ours, theirs


def difference(family: str, ours: list, theirs: list) -> str | None:
    """The first way the adapter's calls differ from the pipeline's (None: equal, dtype and bits).
    HunyuanVideoPipeline casts the timestep to its latents' dtype: fp32 at the first step, then the
    model's (its scheduler step returns the model output's dtype); where a pipeline's own dtype for an
    input changes over a run, the adapter's must be one of them and its value the same."""
    if not len(ours) == len(theirs) >= STEPS:
        return f"{len(ours)} calls, the pipeline's {len(theirs)}"
    mixed = {k for k in ("timestep", "guidance") if len({c[k].dtype for _, c in theirs if k in c}) > 1}
    if not mixed <= ({"timestep"} if family == "hunyuan_video" else set()):
        return f"the pipeline's dtypes of {mixed} change over its run"
    for i, ((e_ours, a), (e_theirs, b)) in enumerate(zip(ours, theirs)):
        if e_ours != e_theirs:
            return f"call {i}: expert {e_ours}, the pipeline's {e_theirs}"
        if a.keys() != b.keys():
            return f"call {i}: inputs {sorted(a)}, the pipeline's {sorted(b)}"
        for key in a:
            x, y = (a[key].float(), b[key].float()) if key in mixed else (a[key], b[key])
            if x.dtype != y.dtype:
                return f"call {i}: {key} in {x.dtype}, the pipeline's {y.dtype}"
            if not torch.equal(x, y):
                return f"call {i}: {key} {a[key].tolist()} vs the pipeline's {b[key].tolist()}"
    if mixed and not {c["timestep"].dtype for _, c in ours} <= {c["timestep"].dtype for _, c in theirs}:
        return "timestep in a dtype the pipeline never passes"
    return None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_timestep_and_guidance_reach_the_transformer_as_the_pipeline_passes_them(
    family, tmp_path, monkeypatch
):
    ours, theirs = timestep_calls(family, tmp_path, monkeypatch)
    assert difference(family, ours, theirs) is None, difference(family, ours, theirs)
