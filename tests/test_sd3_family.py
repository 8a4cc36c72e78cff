"""SD3.5 as a family: the planner's facts (published shapes, exact parameter counts, FLOPs against
torch's flop counter), `digenrl profile`, the engine (colocated and full mode, sharing two runs), the
trained LoRA in StableDiffusion3Pipeline, and learning on the colour reward."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.planner.shapes import attention_fraction, forward_flops, model_shape
from digenrl.planner.workload import Workload
from digenrl.run.rundir import read_metrics
from tests.helpers import FULL_MODE, QUIET, TINY

ROOT = Path(__file__).resolve().parents[1]
TINY_SD3 = ROOT / "configs" / "sd3_tiny.yaml"

#: SD3Transformer2DModel's parameters on the meta device for the published transformer/config.json
#: files. The checkpoints' safetensors hold more (Medium 2.47B, Large 8.15B): the positional table
#: ``pos_embed.pos_embed`` (pos_embed_max_size^2 x d) is a buffer, not a parameter.
EXACT = {"sd3.5_medium": 2_243_171_520, "sd3.5_large": 8_056_627_520}
POS_TABLE = {"sd3.5_medium": 384 * 384 * 1536, "sd3.5_large": 192 * 192 * 2432}
PUBLISHED = {"sd3.5_medium": 2.47e9, "sd3.5_large": 8.15e9}  # the safetensors' tensor counts, rounded


@pytest.mark.parametrize("name", ["sd3.5_medium", "sd3.5_large"])
def test_published_shapes_parameter_counts_and_flops(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")  # its checkpoint is not on this machine
    w = Workload.from_config(cfg)
    assert w.shape.source == {"sd3.5_medium": "SD3.5-Medium", "sd3.5_large": "SD3.5-Large"}[name]
    assert w.params.total == EXACT[name]
    assert w.params.total + POS_TABLE[name] == pytest.approx(PUBLISHED[name], rel=0.005)
    assert 0 < w.params.lora < 0.02 * w.params.total and w.passes == 2  # CFG 4.5: two passes
    t = w.shape.tokens
    assert (t.x, t.text) == (32 * 32, 77 + 128)  # 512px / 8 / 2 patches; CLIP 77 + T5 128
    # doubling every token doubles the linear FLOPs and quadruples the attention products
    doubled = type(t)(2 * t.x, 2 * t.text, t.latent_elements, t.pixels)
    a = attention_fraction(w.shape)
    ratio = forward_flops(w.shape, doubled) / forward_flops(w.shape)
    assert ratio == pytest.approx(2 * (1 - a) + 4 * a, rel=0.02)
    per_token = forward_flops(w.shape) / (t.x + t.text)
    # a dual-stream block sends a token through one stream's weights (half the block's): ~1 FLOP per
    # parameter per token, plus attention
    assert 0.6 * w.params.total < per_token < 1.5 * w.params.total


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sd3.5_medium", "sd3.5_large"])
def test_flop_formula_matches_torch_flop_counter_on_the_published_shape(name):
    """The real-size transformer on the meta device (no memory): the counter reads shapes only."""
    import diffusers
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    w = Workload.from_config(cfg)
    c, t = w.shape.config, w.shape.tokens
    latents = w.shape.adapter.latent_shape_for(cfg.model, c, w.shape.adapter.published_model(cfg.model).vae)
    assert latents == (16, 64, 64)  # 512 px / 8
    with torch.device("meta"):
        net = diffusers.SD3Transformer2DModel(**c)
        inputs = dict(
            hidden_states=torch.randn(1, *latents),
            encoder_hidden_states=torch.randn(1, t.text, c["joint_attention_dim"]),
            pooled_projections=torch.randn(1, c["pooled_projection_dim"]),
            timestep=torch.ones(1),
        )
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            net(**inputs, return_dict=False)
    assert forward_flops(w.shape) == pytest.approx(counter.get_total_flops(), rel=0.01)


@pytest.mark.parametrize("dual", [(0,), ()], ids=["mmdit_x", "mmdit"])
@pytest.mark.parametrize("guidance", [4.5, 1.0])
def test_flop_formula_matches_torch_flop_counter(dual, guidance, monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    import digenrl.adapters.sd3 as sd3
    from digenrl.adapters import adapter_class, build_adapter

    monkeypatch.setitem(
        sd3.TINY_TRANSFORMER, "dual_attention_layers", dual
    )  # Medium's and Large's block kinds
    cfg = load_config(TINY_SD3, [f"sampling.guidance={guidance}", "model.height=64", "model.width=48"])
    ad = build_adapter(cfg.model, cfg.sampling)
    shape = model_shape(cfg.model)
    assert shape.tokens.latent_elements == torch.Size(ad.latent_shape()).numel()
    assert shape.tokens.x == (64 // 4 // 2) * (48 // 4 // 2)
    calls = []
    hook = ad.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randn(1, *ad.latent_shape())
    cond = ad.encode_prompts(["a red apple"])
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        ad.velocity(x, torch.full((1,), 0.5), cond)
    hook.remove()
    passes = adapter_class("sd3").guidance_passes(guidance)
    assert len(calls) == passes == Workload.from_config(cfg).passes
    assert forward_flops(shape) == pytest.approx(counter.get_total_flops() / passes, rel=0.05)


@pytest.mark.slow
def test_profile_runs_on_the_tiny_preset():
    from digenrl.planner.profile import run_profile

    fast = [
        "sampling.steps=2",
        "train.prompts_per_iteration=2",
        "algorithm.group_size=2",
        "train.micro_batch=2",
    ]
    cfg = load_config(TINY_SD3, fast)
    profile = run_profile(cfg, "cpu", batches=[1, 2], repeats=1, warmup=0, min_time=0.0, sharing=0)
    assert profile["model"]["class"] == "SD3Transformer2DModel" and profile["model"]["params"] > 0
    assert profile["workload"]["guidance_passes"] == 2
    assert all(v > 0 for v in profile["measurements"]["rollout_step_s"].values())


# ----------------------------------------------------------------------------- the engine (slow)
MODES = {"colocated": ["placement.mode=colocated"], "full": FULL_MODE}


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, ray_cluster):
    """On the suite's cluster (warm workers): two iterations of `digenrl train` on the tiny preset,
    colocated and in the engine's full mode (disaggregated, GAP, TAG, TSP 2, one-step async); run dirs
    by mode."""
    from digenrl.cli.app import main

    runs = {}
    for mode, sets in MODES.items():
        run = tmp_path_factory.mktemp(f"sd3_{mode}")
        argv = ["digenrl", "train", "-c", str(TINY_SD3), "--run-dir", str(run)]
        for kv in [*TINY, *QUIET, "train.iterations=2", *sets]:
            argv += ["--set", kv]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "argv", argv)
            with pytest.raises(SystemExit) as exc:
                main()
        runs[mode] = (exc.value.code, run)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_engine_trains_two_iterations(engine_runs, mode):
    code, run = engine_runs[mode]
    assert code == 0
    rows = read_metrics(run)
    assert [r["version"] for r in rows] == [1, 2] and all(r["reward_mean"] > 0 for r in rows)


@pytest.mark.slow
def test_trained_lora_loads_into_the_sd3_pipeline_and_changes_its_output(engine_runs):
    from diffusers import StableDiffusion3Pipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from digenrl.policy.model import Policy

    _, run = engine_runs["full"]
    saved = load_file(run / "final" / "pytorch_lora_weights.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # it trained something
    cfg = load_config(TINY_SD3, TINY)
    fresh = Policy(cfg, trainable=False).adapter
    fresh.transformer.delete_adapters("default")
    none = dict.fromkeys(["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3"])
    pipe = StableDiffusion3Pipeline(
        transformer=fresh.transformer, vae=fresh.vae, scheduler=fresh.scheduler, tokenizer_3=None, **none
    )
    pipe.set_progress_bar_config(disable=True)
    cond = fresh.encode_prompts(["a red apple"])
    noise = fresh.initial_noise(1, torch.Generator().manual_seed(0))

    def generate():
        b = cond.batched
        return pipe(
            prompt_embeds=b["prompt_embeds"],
            pooled_prompt_embeds=b["pooled"],
            negative_prompt_embeds=b["neg_prompt_embeds"],
            negative_pooled_prompt_embeds=b["neg_pooled"],
            guidance_scale=cfg.sampling.guidance,
            latents=noise.clone(),
            num_inference_steps=4,
            height=16,
            width=16,
            output_type="latent",
        ).images

    before = generate()
    pipe.load_lora_weights(run / "final")
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert len(loaded) == len(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k.removeprefix("transformer.")], v), k
    assert (generate() - before).abs().max() > 1e-4  # the trained LoRA is loaded and active


@pytest.mark.slow
def test_sd3_learns_the_colour_reward(tmp_path):
    """A short fixed-seed run on two colours: the reward of the last third is above the first third
    (the criterion of tests/test_families.py::test_family_learns)."""
    from digenrl.engine.local import LocalTrainer

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red apple\na red car\na blue apple\na blue car\n")
    cfg = load_config(
        TINY_SD3, ["train.iterations=24", f"prompts.file={prompts}", f"output.run_dir={tmp_path / 'run'}"]
    )
    rewards = [r["reward_mean"] for r in LocalTrainer(cfg).run().metrics]
    first, last = rewards[:8], rewards[-8:]
    gain = statistics.mean(last) - statistics.mean(first)
    noise = (statistics.variance(first) / 8 + statistics.variance(last) / 8) ** 0.5
    assert gain > 0.02 and gain > 2 * noise, (gain, noise, rewards)
