"""Wan2.2 as a family: the planner's facts (published shapes -- A14B holds two experts --, exact
parameter counts, FLOPs against torch's flop counter), `digenrl profile`, the engine (colocated and
full mode for each variant, sharing the runs), the trained LoRA in WanPipeline (both experts), and
learning on the colour reward."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.planner.shapes import forward_flops, model_shape
from digenrl.planner.workload import Workload
from digenrl.run.rundir import read_metrics
from tests.helpers import FULL_MODE, QUIET, TINY

ROOT = Path(__file__).resolve().parents[1]
TINY_CFG = {
    "a14b": ROOT / "configs" / "wan2.2_tiny.yaml",
    "ti2v_5b": ROOT / "configs" / "wan2.2_ti2v_tiny.yaml",
}
REAL = {"a14b": "wan2.2_t2v_a14b", "ti2v_5b": "wan2.2_ti2v_5b"}

#: WanTransformer3DModel's parameters on the meta device for the published transformer/config.json:
#: A14B holds two experts of Wan2.1-T2V-14B's architecture (14,288,491,584 each)
EXPERT_14B = 14_288_491_584
EXACT = {"a14b": 2 * EXPERT_14B, "ti2v_5b": 4_999_787_712}


@pytest.mark.parametrize("variant", REAL)
def test_published_shapes_parameter_counts_and_flops(variant):
    cfg = load_config(ROOT / "configs" / f"{REAL[variant]}.yaml")  # its checkpoint is not on this machine
    w = Workload.from_config(cfg)
    assert w.shape.source == {"a14b": "Wan2.2-T2V-A14B", "ti2v_5b": "Wan2.2-TI2V-5B"}[variant]
    assert w.params.total == EXACT[variant] and w.params.experts == (2 if variant == "a14b" else 1)
    if variant == "a14b":  # the same expert as Wan2.1-T2V-14B, counted independently
        wan21 = Workload.from_config(load_config(ROOT / "configs" / "wan2.1_t2v_14b.yaml"))
        assert w.params.total == 2 * wan21.params.total and w.params.lora == 2 * wan21.params.lora
        # one expert frozen: half the LoRA, and a full fine-tune trains one expert's weights
        frozen = load_config(ROOT / "configs" / f"{REAL[variant]}.yaml", ["model.train_experts=low_noise"])
        assert Workload.from_config(frozen).params.lora == wan21.params.lora
        full = load_config(
            ROOT / "configs" / f"{REAL[variant]}.yaml", ["model.train_experts=high_noise", "model.lora=null"]
        )
        assert Workload.from_config(full).trained_params == EXPERT_14B
        # one step runs one expert: the FLOPs of a pass are Wan2.1-14B's at the same tokens
        assert forward_flops(w.shape) == pytest.approx(forward_flops(wan21.shape))
    assert w.passes == 2  # CFG
    t = w.shape.tokens
    assert (t.x, t.text) == {"a14b": (21 * 30 * 52, 512), "ti2v_5b": (31 * 22 * 40, 512)}[variant]


def test_a_frozen_expert_holds_its_weights_and_no_optimizer_state_in_the_memory_model():
    """Full fine-tune of A14B's low-noise expert: fp32 masters, gradients and AdamW moments for one
    expert (14.3B), the frozen one in bf16 -- not both experts' optimizer state (hand count)."""
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.params import CostParams

    cfg = load_config(
        ROOT / "configs" / "wan2.2_t2v_a14b.yaml", ["model.train_experts=low_noise", "model.lora=null"]
    )
    parts = MemoryModel(Workload.from_config(cfg), CostParams()).train_parts(4, 1, True)
    assert parts["fp32 masters"] == parts["fp32 grads"] == EXPERT_14B * 4 / 4
    assert parts["AdamW state"] == EXPERT_14B * 8 / 4
    assert parts["frozen expert"] == EXPERT_14B * 2 / 4  # bf16


@pytest.mark.slow
@pytest.mark.parametrize("variant", REAL)
def test_flop_formula_matches_torch_flop_counter_on_the_published_shape(variant):
    """One expert at real size on fake tensors (no memory; Wan's rotary tables refuse the meta device),
    attention as its math kernel (counted); TI2V with its per-token timesteps."""
    import diffusers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    # A14B's expert at Flow-GRPO's 240x416 x 33 (3,510 tokens; the 32,760 of 480p cost ~10x the time)
    small = ["model.height=240", "model.width=416", "model.frames=33"] if variant == "a14b" else []
    cfg = load_config(ROOT / "configs" / f"{REAL[variant]}.yaml", small)
    w = Workload.from_config(cfg)
    c, t = w.shape.config, w.shape.tokens
    ad = w.shape.adapter
    latents = ad.latent_shape_for(cfg.model, c, ad.published_model(cfg.model).vae)
    assert latents == {"a14b": (16, 9, 30, 52), "ti2v_5b": (48, 31, 44, 80)}[variant]
    with FakeTensorMode():
        net = diffusers.WanTransformer3DModel(**c)
        inputs = dict(
            hidden_states=torch.randn(1, *latents),
            encoder_hidden_states=torch.randn(1, t.text, c["text_dim"]),
            timestep=torch.ones(1) if variant == "a14b" else torch.ones(1, t.x),  # TI2V: per token
        )
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            net(**inputs, return_dict=False)
    assert forward_flops(w.shape) == pytest.approx(counter.get_total_flops(), rel=0.01)


@pytest.mark.parametrize("guidance", [4.0, 1.0])
@pytest.mark.parametrize("variant", TINY_CFG)
def test_flop_formula_matches_torch_flop_counter(variant, guidance):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from digenrl.adapters import build_adapter

    cfg = load_config(TINY_CFG[variant], [f"sampling.guidance={guidance}", "model.width=48"])
    ad = build_adapter(cfg.model, cfg.sampling)
    shape = model_shape(cfg.model)
    assert shape.tokens.latent_elements == torch.Size(ad.latent_shape()).numel()
    x = torch.randn(1, *ad.latent_shape())
    cond = ad.encode_prompts(["a red apple"])
    passes = Workload.from_config(cfg).passes
    assert passes == (2 if guidance > 1 else 1)
    for sigma in (0.95, 0.5):  # A14B: the high-noise, then the low-noise expert
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            ad.velocity(x, torch.full((1,), sigma), cond)
        assert forward_flops(shape) == pytest.approx(counter.get_total_flops() / passes, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("variant", TINY_CFG)
def test_profile_runs_on_the_tiny_preset(variant):
    from digenrl.planner.profile import run_profile

    fast = [
        "sampling.steps=2",
        "train.prompts_per_iteration=2",
        "algorithm.group_size=2",
        "train.micro_batch=2",
    ]
    cfg = load_config(TINY_CFG[variant], fast)
    profile = run_profile(cfg, "cpu", batches=[1, 2], repeats=1, warmup=0, min_time=0.0, sharing=0)
    assert profile["model"]["params"] > 0 and profile["workload"]["guidance_passes"] == 2
    assert all(v > 0 for v in profile["measurements"]["rollout_step_s"].values())


# ----------------------------------------------------------------------------- the engine (slow)
#: the A14B colocated run freezes the high-noise expert (model.train_experts); the full-mode run trains both
RUNS = {
    ("a14b", "colocated"): ["placement.mode=colocated", "model.train_experts=low_noise"],
    ("a14b", "full"): FULL_MODE,
    ("ti2v_5b", "colocated"): ["placement.mode=colocated"],
    ("ti2v_5b", "full"): FULL_MODE,
}
_RUNS: dict = {}


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, ray_cluster):
    """On the suite's cluster (warm workers): two iterations of `digenrl train` on a tiny preset in
    one mode, run once per module and shared."""
    from digenrl.cli.app import main

    def run(variant: str, mode: str):
        if (variant, mode) not in _RUNS:
            out = tmp_path_factory.mktemp(f"wan22_{variant}_{mode}")
            argv = ["digenrl", "train", "-c", str(TINY_CFG[variant]), "--run-dir", str(out)]
            for kv in [*TINY, *QUIET, "train.iterations=2", *RUNS[variant, mode]]:
                argv += ["--set", kv]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sys, "argv", argv)
                with pytest.raises(SystemExit) as exc:
                    main()
            _RUNS[variant, mode] = (exc.value.code, out)
        return _RUNS[variant, mode]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("variant, mode", RUNS)
def test_engine_trains_two_iterations(engine_run, variant, mode):
    code, run = engine_run(variant, mode)
    assert code == 0
    rows = read_metrics(run)
    assert [r["version"] for r in rows] == [1, 2] and all(r["reward_mean"] > 0 for r in rows)


def _pipeline(cfg):
    """A stock WanPipeline over a fresh (untrained) policy's modules; the experts without adapters."""
    from diffusers import WanPipeline

    from digenrl.adapters import build_adapter

    ad = build_adapter(cfg.model.model_copy(update={"lora": None}), cfg.sampling)
    experts = ad.transformer.experts() if ad.two_experts else [ad.transformer, None]
    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=ad.vae,
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=ad.boundary_ratio,
        expand_timesteps=ad.expand_timesteps,
        scheduler=ad.flow_scheduler({"shift": cfg.sampling.shift}),
    )
    pipe.set_progress_bar_config(disable=True)
    cond = ad.encode_prompts(["a red apple"])
    noise = ad.initial_noise(1, torch.Generator().manual_seed(0))
    m, s = cfg.model, cfg.sampling

    def generate():
        extra = {"guidance_scale_2": s.guidance_2} if ad.two_experts else {}
        return pipe(
            prompt_embeds=cond.batched["prompt_embeds"],
            negative_prompt_embeds=cond.batched["neg_prompt_embeds"],
            guidance_scale=s.guidance,
            latents=noise.clone(),
            num_inference_steps=4,
            height=m.height,
            width=m.width,
            num_frames=m.frames,
            output_type="latent",
            **extra,
        ).frames

    return pipe, generate


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant, mode, files",
    [
        ("a14b", "full", {"transformer": "pytorch_lora_weights.safetensors", "transformer_2": "_2"}),
        ("a14b", "colocated", {"transformer_2": "_2"}),  # high-noise expert frozen: no file for it
        ("ti2v_5b", "colocated", {"transformer": "pytorch_lora_weights.safetensors"}),
    ],
)
def test_trained_lora_loads_into_wan_pipeline_and_changes_its_output(engine_run, variant, mode, files):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    _, run = engine_run(variant, mode)
    names = {
        k: (v if v.endswith(".safetensors") else "pytorch_lora_weights_2.safetensors")
        for k, v in files.items()
    }
    assert sorted(p.name for p in (run / "final").glob("*.safetensors")) == sorted(names.values())
    pipe, generate = _pipeline(load_config(TINY_CFG[variant], TINY))
    before = generate()
    for component, name in names.items():
        saved = load_file(run / "final" / name)
        assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # it trained something
        pipe.load_lora_weights(
            run / "final", weight_name=name, load_into_transformer_2=component == "transformer_2"
        )
        net = getattr(pipe, component)
        loaded = get_peft_model_state_dict(net, adapter_name=net.active_adapters()[0])
        assert len(loaded) == len(saved)
        for k, v in saved.items():
            assert torch.equal(loaded[k.removeprefix("transformer.")], v), k
    assert (generate() - before).abs().max() > 1e-4  # the trained LoRA is loaded and active


@pytest.mark.slow
@pytest.mark.parametrize("variant", TINY_CFG)
def test_wan22_learns_the_colour_reward(variant, tmp_path):
    """A short fixed-seed run on two colours: the reward of the last third is above the first third
    (the criterion of tests/test_families.py::test_family_learns)."""
    from digenrl.engine.local import LocalTrainer

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red apple\na red car\na blue apple\na blue car\n")
    cfg = load_config(
        TINY_CFG[variant],
        ["train.iterations=24", f"prompts.file={prompts}", f"output.run_dir={tmp_path / 'run'}"],
    )
    rewards = [r["reward_mean"] for r in LocalTrainer(cfg).run().metrics]
    first, last = rewards[:8], rewards[-8:]
    gain = statistics.mean(last) - statistics.mean(first)
    noise = (statistics.variance(first) / 8 + statistics.variance(last) / 8) ** 0.5
    assert gain > 0.02 and gain > 2 * noise, (gain, noise, rewards)
