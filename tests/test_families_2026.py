"""Z-Image, FLUX.2 and HunyuanVideo-1.5 (text and image to video) as families: the planner's facts
(published shapes, exact parameter counts, FLOPs against torch's flop counter), the engine from the CLI
(each tiny config, 2 iterations colocated and in the full disaggregated mode), and the trained LoRA in
the stock pipeline."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.planner.shapes import forward_flops, model_shape
from digenrl.planner.workload import Workload
from digenrl.run.rundir import read_metrics
from tests.helpers import FULL_MODE, QUIET, TINY

LORA_FILE = "pytorch_lora_weights.safetensors"

ROOT = Path(__file__).resolve().parents[1]
FRAME = str(ROOT / "configs" / "edits" / "tiny_16" / "images" / "blue.png")  # a shipped first frame
CONFIGS = {
    "z_image": ROOT / "configs" / "z_image_tiny.yaml",
    "flux2": ROOT / "configs" / "flux2_tiny.yaml",
    "hunyuan_video15": ROOT / "configs" / "hunyuan_video15_tiny.yaml",
    "hunyuan_video15_i2v": ROOT / "configs" / "hunyuan_video15_i2v_tiny.yaml",
}

#: the transformer's parameters on the meta device at the published transformer/config.json, and the
#: published size they round to (Z-Image-Turbo 6B, FLUX.2 [klein] 4B, [dev] 32B, HunyuanVideo-1.5 8.3B)
PUBLISHED = {
    "Z-Image-Turbo": (["model.adapter=z_image", "model.pretrained=/x/Z-Image-Turbo"], 6_154_908_736, 6e9, 2),
    "FLUX.2-klein-4B": (
        ["model.adapter=flux2", "model.pretrained=/x/FLUX.2-klein-4B"],
        3_875_544_576,
        4e9,
        2,
    ),
    "FLUX.2-dev": (["model.adapter=flux2", "model.pretrained=/x/FLUX.2-dev"], 32_223_281_152, 32e9, 1),
    "HunyuanVideo-1.5": (
        ["model.adapter=hunyuan_video15", "model.pretrained=/x/HunyuanVideo-1.5", "model.frames=5"],
        8_326_608_160,
        8.3e9,
        2,
    ),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_shapes_and_parameter_counts(name):
    sets, exact, rounded, passes = PUBLISHED[name]
    w = Workload.from_config(load_config(None, [*sets, "sampling.guidance=4.0", "model.lora.targets=null"]))
    assert w.params.total == exact and w.params.total == pytest.approx(rounded, rel=0.06)
    assert 0 < w.params.lora < 0.01 * w.params.total
    assert w.passes == passes
    blocks = {"Z-Image-Turbo": 34, "FLUX.2-klein-4B": 25, "FLUX.2-dev": 56, "HunyuanVideo-1.5": 54}
    assert w.params.blocks == blocks[name]


def test_the_shipped_flux2_dev_config_is_costed_as_dev():
    """configs/flux2_dev.yaml: the planner reads [dev] (32B, 56 blocks, the guidance embedding's one
    pass) from the checkpoint directory's name, as the recipe's placeholder names it."""
    w = Workload.from_config(load_config(ROOT / "configs" / "flux2_dev.yaml"))
    assert (w.params.total, w.params.blocks, w.passes) == (PUBLISHED["FLUX.2-dev"][1], 56, 1)


def _counted(cfg, prompt: str):
    """(forward_flops of the configured shape, torch's count of one transformer pass)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from digenrl.adapters import build_adapter

    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts([prompt], [FRAME]) if ad.edits else ad.encode_prompts([prompt])
    x = torch.randn(1, *ad.latent_shape())
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        ad.forward_pass(x, ad.timestep(torch.full((1,), 0.5)), ad.pass_inputs(cond, False))
    return forward_flops(model_shape(cfg.model)), counter.get_total_flops()


@pytest.mark.parametrize("family", CONFIGS)
def test_flop_formula_matches_torch_flop_counter(family):
    # Z-Image pads image and caption tokens to multiples of 32: a 32-word caption, 64 image tokens
    # (image to video: 16 x 16, the square bucket of its tiny target size; its 729 image tokens attended)
    side = 16 if family == "hunyuan_video15_i2v" else 32
    cfg = load_config(
        CONFIGS[family], [f"model.height={side}", f"model.width={side}", "model.max_text_len=32"]
    )
    ours, counted = _counted(cfg, " ".join(f"word{i}" for i in range(32)))
    assert ours == pytest.approx(counted, rel=0.05)


# ----------------------------------------------------------------------------- the engine (slow)
#: each family's 2 iterations in both engine modes (a tiny config with nothing but itself)
MODES = {"colocated": ["placement.mode=colocated"], "full": FULL_MODE}
RUNS = [(family, mode) for family in CONFIGS for mode in MODES]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, ray_cluster):
    """On the suite's cluster (warm workers), from another working directory (the image-to-video
    config finds its shipped first frames from its own folder): two iterations of `digenrl train` per
    family and mode; (exit code, run dir) by (family, mode)."""
    from digenrl.cli.app import main

    runs = {}
    elsewhere = tmp_path_factory.mktemp("cwd")
    for family, mode in RUNS:
        run = tmp_path_factory.mktemp(f"{family}_{mode}")
        argv = ["digenrl", "train", "-c", str(CONFIGS[family]), "--run-dir", str(run)]
        for kv in [*TINY, *QUIET, "train.iterations=2", *MODES[mode]]:
            argv += ["--set", kv]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "argv", argv)
            mp.chdir(elsewhere)
            with pytest.raises(SystemExit) as exc:
                main()
        runs[family, mode] = (exc.value.code, run)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("family, mode", RUNS)
def test_engine_trains_two_iterations(engine_runs, family, mode):
    code, run = engine_runs[family, mode]
    assert code == 0
    rows = read_metrics(run)
    assert [r["version"] for r in rows] == [1, 2] and all(r["reward_mean"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("family", CONFIGS)
def test_trained_lora_loads_into_the_stock_pipeline_and_changes_its_output(engine_runs, family):
    import diffusers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from digenrl.algorithms.sde import sample
    from digenrl.policy.model import Policy

    _, run = engine_runs[family, "full"]
    saved = load_file(run / "final" / "pytorch_lora_weights.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # it trained something
    fresh = Policy(load_config(CONFIGS[family], TINY), trainable=False).adapter
    fresh.transformer.delete_adapters("default")
    cls = getattr(diffusers, fresh.pipeline_class)
    parts = {"transformer": fresh.transformer, "vae": fresh.vae, "scheduler": fresh.scheduler}
    names = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "is_distilled")]
    pipe = cls(**{n: parts.get(n) for n in names})
    if fresh.edits:  # image to video: the prompt with its first frame
        cond = fresh.encode_prompts(["make it red"], [FRAME])
    else:
        cond = fresh.encode_prompts(["a red apple"])
    noise = fresh.initial_noise(1, torch.Generator().manual_seed(0))
    before = sample(fresh, cond, noise, fresh.sigmas(4), "flow_grpo", 0.0, None).latents[:, -1]
    if hasattr(pipe, "load_lora_weights"):
        pipe.load_lora_weights(run / "final")
    else:  # HunyuanVideo15Pipeline has no LoRA loader: its transformer reads the file
        pipe.transformer.load_lora_adapter(run / "final", prefix="transformer", weight_name=LORA_FILE)
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert len(loaded) == len(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k.removeprefix("transformer.")], v), k
    after = sample(fresh, cond, noise, fresh.sigmas(4), "flow_grpo", 0.0, None).latents[:, -1]
    assert (after - before).abs().max() > 1e-4  # the loaded LoRA is active in the pipeline's transformer
