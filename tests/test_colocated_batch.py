"""``engine.colocated_batch``: a worker that also trains (colocated, TAG) samples a whole unit (or N
samples) per forward instead of the train forwards' batches. The same seeds give the same samples
to rounding (at noise 0 also diffusers' FluxPipeline's); resolved once into the layout (auto: the
whole unit on GPUs of known memory, the trainer's batches on CPU pools). The engine run with it is
test_engine.py's ``colocated`` mode (timeline invariants, the local trainer's update)."""

from __future__ import annotations

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.errors import UserError
from digenrl.placement.resolve import resolve
from digenrl.policy.model import Policy
from digenrl.units.rollout import rollout_unit
from tests.helpers import TINY

COLOCATED = [*TINY, "placement.mode=colocated", "engine.unit_groups=2", "train.micro_batch=1"]
H800 = "cluster.pools=[{name: rollout, device: H800, count: 2}, {name: trainer, device: H800, count: 2}]"


@pytest.fixture(scope="module")
def units():
    """One unit of two groups (8 samples) rolled out at the trainer's batches (micro-batch 1) and at
    colocated batches 8 and 3, at noise 0 and at the configured noise, from one policy."""
    out = {}
    for noise in ("0", "0.7"):
        cfg = load_config(None, [*COLOCATED, f"sampling.noise_level={noise}"])
        torch.manual_seed(cfg.train.seed)
        policy = Policy(cfg)
        prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(0, 2)
        for batch in (None, 8, 3):
            out[noise, batch] = rollout_unit(policy, prompts, [0, 1], 0, cfg.train.seed, batch=batch)[0]
        out[noise, "policy"] = policy
    return out


@pytest.mark.parametrize("noise", ["0", "0.7"])
def test_a_unit_in_one_forward_generates_the_same_samples(units, noise):
    ref = units[noise, None]
    for batch in (8, 3):
        got = units[noise, batch]
        assert got.version == ref.version and got.group_ids == ref.group_ids
        torch.testing.assert_close(got.latents, ref.latents, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.log_probs, ref.log_probs, atol=1e-4, rtol=0)
    assert (ref.latents[:, -1] - ref.latents[:, 0]).abs().mean() > 1e-2  # the samples moved
    if noise == "0.7":  # not vacuous: the noise really drives the samples apart from the ODE's
        assert (ref.latents[:, -1] - units["0", None].latents[:, -1]).abs().max() > 1e-3


def test_the_batched_ode_unit_equals_flux_pipeline(units):
    from diffusers import FluxPipeline

    got, ad = units["0", 8], units["0", "policy"].adapter
    cfg = units["0", "policy"].cfg
    pipe = FluxPipeline(
        scheduler=ad.flow_scheduler(dict(ad.scheduler.config)),
        vae=ad.vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=ad.transformer,
    )
    theirs = pipe(
        prompt_embeds=got.cond.batched["prompt_embeds"],
        pooled_prompt_embeds=got.cond.batched["pooled"],
        latents=got.latents[:, 0].clone(),
        num_inference_steps=cfg.sampling.steps,
        guidance_scale=cfg.sampling.guidance,
        height=cfg.model.height,
        width=cfg.model.width,
        output_type="latent",
    ).images
    torch.testing.assert_close(got.latents[:, -1], theirs, atol=1e-5, rtol=1e-5)


def test_the_layout_holds_the_colocated_batch():
    fixed = resolve(load_config(None, [*COLOCATED, "engine.colocated_batch=3"]))
    assert fixed.settings.colocated_batch == 3
    assert fixed.settings.sampling_batch("both") == fixed.settings.sampling_batch("trainer") == 3
    assert fixed.settings.sampling_batch("rollout") is None  # a rollout-only worker: engine.rollout_batch
    assert any("colocated batch 3" in line for line in fixed.describe())
    assert resolve(load_config(None, COLOCATED)).settings.colocated_batch is None  # CPU pools: auto = trainer
    on_gpu = resolve(load_config(None, [*COLOCATED, H800]))
    unit = on_gpu.plan.unit_size * 4  # auto: the whole unit (the plan's, over the 4 devices)
    assert on_gpu.settings.colocated_batch == unit and unit >= 2
    pinned = resolve(load_config(None, [*COLOCATED, H800, "engine.colocated_batch=trainer"]))
    assert pinned.settings.colocated_batch is None
    disagg = [*TINY, "placement.mode=disaggregated", "engine.tsp_degree=1", "engine.max_staleness=0", H800]
    assert resolve(load_config(None, [*disagg, "engine.tag=false"])).settings.colocated_batch is None
    assert resolve(load_config(None, [*disagg, "engine.tag=true"])).settings.colocated_batch == 4  # TAG


@pytest.mark.parametrize("value", [0, "whole", -2])
def test_a_bad_colocated_batch_names_the_field(value):
    with pytest.raises(UserError, match="engine.colocated_batch"):
        load_config(None, [f"engine.colocated_batch={value}"])


def test_the_planner_times_a_colocated_unit_at_its_batch():
    """The cost model samples a colocated worker's unit of 8 Qwen-Image samples (true CFG: 2 passes of
    1024 + 256 tokens) in one forward, not the trainer's two of 4: one call's kernels instead of two,
    the per-row FLOPs and memory-bound bytes the same (a hand computation)."""
    from dataclasses import replace
    from pathlib import Path

    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.gpus import load_cluster
    from digenrl.planner.workload import Workload

    root = Path(__file__).resolve().parents[1]
    qwen = load_config(root / "configs" / "qwen_image.yaml")
    cluster = load_cluster(root / "configs" / "clusters" / "16xH800.yaml")
    cost = CostModel(Workload.from_config(qwen), cluster)
    setup = cost.colocated_setup("H800", 16, 0.5, 4)
    assert (setup.rollout_batch, setup.micro_batch, setup.cfg_batched) == (8, 4, True)
    from digenrl.placement.devices import DEVICES
    from digenrl.planner.gpus import KERNEL_EFFICIENCY
    from digenrl.planner.op_counts import forward_ops
    from digenrl.planner.shapes import forward_flops

    t, w, dev = cost.times("H800", setup), cost.workload, DEVICES["H800"]
    ops, elems = forward_ops(w.shape)
    kernels = ops * cost.params.op_launch_s
    row = forward_flops(w.shape) / (dev.bf16_flops * KERNEL_EFFICIENCY["H800"][0])
    row += elems * w.dtype_bytes / (dev.mem_bw * cost.params.mem_bw_efficiency)
    assert t.rollout_step(8) / (2 * t.rollout_step(4)) == pytest.approx(
        (16 * row + kernels) / (2 * (8 * row + kernels)), rel=1e-6
    )
    unit, trainer = (
        cost.rollout_unit("H800", 0.5, setup)[0],
        cost.rollout_unit("H800", 0.5, replace(setup, rollout_batch=None))[0],
    )
    assert unit < 0.95 * trainer
    pinned = CostModel(
        Workload.from_config(
            load_config(root / "configs" / "qwen_image.yaml", ["engine.colocated_batch=trainer"])
        ),
        cluster,
    )
    assert pinned.colocated_setup("H800", 16, 0.5, 4).rollout_batch is None
