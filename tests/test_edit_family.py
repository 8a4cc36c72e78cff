"""FLUX.1 Kontext and Qwen-Image-Edit as families: the planner's facts (published shapes, exact parameter
counts, FLOPs against torch's flop counter: the input image's tokens lengthen the sequence), the engine
(colocated, long enough for the colour reward to move, and the full mode, one run each per family), the
edit reward reading the input image from the metadata, and the trained LoRA in the stock pipelines."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from digenrl.config.run import load_config
from digenrl.planner.shapes import attention_fraction, forward_flops, model_shape
from digenrl.planner.workload import Workload
from digenrl.run.rundir import read_metrics
from tests.helpers import FULL_MODE, QUIET, TINY, write_edit_set

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = {f: ROOT / "configs" / f"{f}_tiny.yaml" for f in ("flux_kontext", "qwen_image_edit")}
SIZE = {"flux_kontext": (16, 16), "qwen_image_edit": (32, 32)}  # the suite's 16 px; Qwen-Image-Edit's 32
#: the transformers' parameters on the meta device: the published checkpoints' (FLUX.1-Kontext-dev is
#: FLUX.1-dev's architecture, 11.9B; Qwen-Image-Edit Qwen-Image's, 20.4B)
EXACT = {"flux1_kontext_dev": 11_901_408_320, "qwen_image_edit": 20_430_401_088}
#: image tokens at 512 px: the output's 32 x 32 packed grid, then the input image's at its pipeline's
#: conditioning size, 64 x 64 -- Kontext's preferred 1024 x 1024 for a square, Qwen-Image-Edit's 1024^2 area
IMAGE_TOKENS = {"flux1_kontext_dev": 1024 + 4096, "qwen_image_edit": 1024 + 4096}
#: the colour-learning rows: the instruction names the colour, the input image has another one
ROWS = [
    ("make it red", "blue"),
    ("make it blue", "red"),
    ("make it red", "green"),
    ("make it blue", "yellow"),
]


@pytest.mark.parametrize("name", ["flux1_kontext_dev", "qwen_image_edit"])
def test_published_shapes_parameter_counts_and_tokens(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")  # its checkpoint is not on this machine
    w = Workload.from_config(cfg)
    assert (
        w.shape.source
        == {"flux1_kontext_dev": "FLUX.1-Kontext-dev (12B)", "qwen_image_edit": "Qwen-Image-Edit (20B)"}[name]
    )
    assert w.params.total == EXACT[name]
    t = w.shape.tokens
    assert t.x == IMAGE_TOKENS[name] and t.latent_elements == 16 * 64 * 64  # the state: the output's alone
    # the input image's tokens raise the cost of a pass above the same model's text-to-image pass
    plain = type(t)(1024, t.text, t.latent_elements, t.pixels)
    a = attention_fraction(w.shape)
    assert forward_flops(w.shape) / forward_flops(w.shape, plain) > (t.x + t.text) / (1024 + t.text)
    assert 0 < a < 1


def edit_adapter(family, tmp_path, guidance=None):
    from digenrl.adapters import build_adapter

    h, w = SIZE[family]
    sets = [f"model.height={h}", f"model.width={w}"] + ([f"sampling.guidance={guidance}"] if guidance else [])
    cfg = load_config(TINY_CONFIG[family], sets)
    path = write_edit_set(tmp_path / "edits", h, w)
    rows = [line for line in path.read_text().splitlines()]
    images = [str(path.parent / "images" / f"{c}.png") for c in ("blue", "red")]
    return cfg, build_adapter(cfg.model, cfg.sampling), rows, images


@pytest.mark.parametrize(
    "family,guidance", [("flux_kontext", 2.5), ("qwen_image_edit", 4.0), ("qwen_image_edit", 1.0)]
)
def test_flop_formula_matches_torch_flop_counter(family, guidance, tmp_path):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from digenrl.adapters import adapter_class

    cfg, ad, _, images = edit_adapter(family, tmp_path, guidance)
    shape = model_shape(cfg.model)
    cond = ad.cond_for(["make it red"], images[:1])
    if ad.trims_text:  # the formula at model.max_text_len: the padded call (tests/test_text_trim.py: trimmed)
        cond = type(cond)(cond.batched)
    n = ad.latent_shape()[0]
    assert shape.tokens.x == n + cond.batched["image_latents"].shape[1]
    calls = []
    hook = ad.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randn(1, *ad.latent_shape())
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        ad.velocity(x, torch.full((1,), 0.5), cond)
    hook.remove()
    passes = adapter_class(family).guidance_passes(guidance)
    assert len(calls) == passes == Workload.from_config(cfg).passes
    assert forward_flops(shape) == pytest.approx(counter.get_total_flops() / passes, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flux1_kontext_dev", "qwen_image_edit"])
def test_flop_formula_matches_torch_flop_counter_on_the_published_shape(name):
    """The real-size transformer on the meta device, fed the output's and the input image's tokens."""
    import diffusers
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    w = Workload.from_config(cfg)
    c, t = w.shape.config, w.shape.tokens
    with torch.device("meta"):
        if name == "flux1_kontext_dev":
            net = diffusers.FluxTransformer2DModel(**c)
            inputs = dict(
                pooled_projections=torch.randn(1, c["pooled_projection_dim"]),
                guidance=torch.ones(1),
                txt_ids=torch.zeros(t.text, 3),
                img_ids=torch.zeros(t.x, 3),
            )
        else:
            net = diffusers.QwenImageTransformer2DModel(**c)
            inputs = dict(img_shapes=[[(1, 32, 32), (1, 64, 64)]], encoder_hidden_states_mask=None)
        inputs.update(
            hidden_states=torch.randn(1, t.x, c["in_channels"]),
            encoder_hidden_states=torch.randn(1, t.text, c["joint_attention_dim"]),
            timestep=torch.ones(1),
        )
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            net(**inputs, return_dict=False)
    assert forward_flops(w.shape) == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_edit_reward_reads_the_input_image_from_the_metadata(tmp_path):
    """A rollout unit's decoded samples reach the reward with their row's input image path in the
    metadata; source_similarity equals 1 - the mean RGB distance to that image, read here with PIL."""
    from digenrl.data.prompts import PromptSampler, check_prompts
    from digenrl.policy.model import Policy
    from digenrl.rewards.base import score
    from digenrl.units.rollout import rollout_unit

    h, w = SIZE["flux_kontext"]
    path = write_edit_set(tmp_path / "edits", h, w)
    cfg = load_config(
        TINY_CONFIG["flux_kontext"],
        [*TINY, "sampling.steps=2", f"prompts.file={path}", "reward.components=[{name: source_similarity}]"],
    )
    prompts = PromptSampler(check_prompts(cfg), 0).for_iteration(0, 2)
    policy = Policy(cfg, trainable=False)
    _, decoded = rollout_unit(policy, prompts, [0, 1], 0, 0)
    from digenrl.rewards import build_reward

    scores = score(build_reward(cfg.reward), decoded)
    assert [m["image"] for m in decoded.metadata] == [p.meta["image"] for p in prompts for _ in range(4)]
    for i, meta in enumerate(decoded.metadata):
        src = np.asarray(Image.open(meta["image"]).convert("RGB"), dtype=np.float64) / 255
        got = decoded.pixels[i].permute(1, 2, 0).double().numpy()
        expected = 1 - (np.linalg.norm(got - src, axis=-1) / 3**0.5).mean()
        assert scores.total[i].item() == pytest.approx(expected, abs=1e-5)
    # the two rows' sources differ (blue, red): the same pixels score differently against them
    assert scores.total[:4].mean() != pytest.approx(scores.total[4:].mean(), abs=1e-3)


# ----------------------------------------------------------------------------- the engine (slow)
#: per family, the colocated run: long enough (fixed seed) for the colour reward to move
LEARN = {
    "flux_kontext": ["train.iterations=8", "train.lr=2e-2", "algorithm.group_size=8"],
    "qwen_image_edit": [
        "train.iterations=8",
        "train.lr=2e-2",
        "algorithm.group_size=8",
        "sampling.guidance=1.0",
    ],
}
#: the full mode's 2 iterations also score the edit's similarity to its input image (read from the metadata)
FULL = [
    *FULL_MODE,
    "train.iterations=2",
    "reward.components=[{name: prompt_color}, {name: source_similarity, weight: 0.5}]",
]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, ray_cluster):
    """On the suite's cluster (warm workers). Per family, `digenrl train` colocated (LEARN) and in
    the engine's full mode (disaggregated, GAP,
    TAG, TSP 2, one-step async; 2 iterations) on a generated edit set; (exit code, run dir) by (family,
    mode)."""
    from digenrl.cli.app import main

    runs = {}
    for family, config in TINY_CONFIG.items():
        h, w = SIZE[family]
        data = write_edit_set(tmp_path_factory.mktemp(f"{family}_set"), h, w, ROWS)
        modes = {"colocated": ["placement.mode=colocated", *LEARN[family]], "full": FULL}
        for mode, sets in modes.items():
            run = tmp_path_factory.mktemp(f"{family}_{mode}")
            argv = ["digenrl", "train", "-c", str(config), "--run-dir", str(run)]
            size = [f"model.height={h}", f"model.width={w}", f"prompts.file={data}", "sampling.steps=4"]
            for kv in [*TINY, *QUIET, *size, *sets]:
                argv += ["--set", kv]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sys, "argv", argv)
                with pytest.raises(SystemExit) as exc:
                    main()
            runs[family, mode] = (exc.value.code, run)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_CONFIG)
def test_engine_trains_and_the_colour_reward_moves(engine_runs, family):
    code, run = engine_runs[family, "colocated"]
    assert code == 0
    rewards = [r["reward_mean"] for r in read_metrics(run)]
    assert len(rewards) == 8
    gain = statistics.mean(rewards[-3:]) - statistics.mean(rewards[:3])
    assert gain > 0.02, rewards
    code, run = engine_runs[family, "full"]
    rows = read_metrics(run)
    assert code == 0 and [r["version"] for r in rows] == [1, 2]
    # the edit reward read each row's input image: blue / red / green / yellow sources, never 0 or 1
    assert all(0 < r["reward/source_similarity"] < 1 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_CONFIG)
def test_trained_lora_loads_into_the_stock_pipeline_and_changes_its_output(
    engine_runs, family, tmp_path, monkeypatch
):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from digenrl.policy.model import Policy
    from tests.test_edit_adapters import edit_pipeline, run_pipeline

    _, run = engine_runs[family, "full"]
    saved = load_file(run / "final" / "pytorch_lora_weights.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # it trained something
    h, w = SIZE[family]
    data = write_edit_set(tmp_path / "edits", h, w)
    cfg = load_config(
        TINY_CONFIG[family], [*TINY, f"model.height={h}", f"model.width={w}", f"prompts.file={data}"]
    )
    fresh = Policy(cfg, trainable=False).adapter
    fresh.transformer.delete_adapters("default")
    images = [str(data.parent / "images" / "blue.png")]
    cond = fresh.cond_for(["make it red"], images)
    noise = fresh.initial_noise(1, torch.Generator().manual_seed(0))
    pipe = edit_pipeline(family, fresh, monkeypatch)
    before = run_pipeline(pipe, family, cfg, cond, noise, images, 4, 0, "latent")[1]
    pipe.load_lora_weights(run / "final")
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert len(loaded) == len(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k.removeprefix("transformer.")], v), k
    after = run_pipeline(pipe, family, cfg, cond, noise, images, 4, 0, "latent")[1]
    assert (after - before).abs().max() > 1e-4  # the trained LoRA is loaded and active


@pytest.mark.slow
def test_profile_runs_on_the_tiny_preset(tmp_path):
    """`digenrl profile` on an edit family: its encode calls carry each row's input image."""
    from digenrl.planner.profile import run_profile

    data = write_edit_set(tmp_path / "edits", *SIZE["qwen_image_edit"])
    fast = [
        "sampling.steps=2",
        "train.prompts_per_iteration=2",
        "algorithm.group_size=2",
        "train.micro_batch=2",
    ]
    cfg = load_config(TINY_CONFIG["qwen_image_edit"], [*fast, f"prompts.file={data}"])
    profile = run_profile(cfg, "cpu", batches=[1, 2], repeats=1, warmup=0, min_time=0.0, sharing=0)
    assert (
        profile["model"]["class"] == "QwenImageTransformer2DModel"
        and profile["workload"]["guidance_passes"] == 2
    )
    assert all(v > 0 for v in profile["measurements"]["rollout_step_s"].values())


@pytest.mark.slow
def test_eval_scores_an_edit_checkpoint_on_its_input_images(engine_runs, tmp_path, monkeypatch, capsys):
    """`digenrl eval` on an edit run: each prompt's input image conditions it, and source_similarity
    (read from the metadata) scores the result against it."""
    import json

    from tests.helpers import cli

    _, run = engine_runs["flux_kontext", "full"]
    data = write_edit_set(tmp_path / "edits", *SIZE["flux_kontext"], ROWS)
    code, out, err = cli(monkeypatch, capsys, "eval", "--checkpoint", str(run), "--prompts", str(data))
    assert code == 0, err
    report = json.loads(next((run / "eval").glob("*/eval.json")).read_text())
    assert report["adapter"] == "flux_kontext" and report["prompts"] == [text for text, _ in ROWS]
    assert set(report["rewards"]) == {"prompt_color", "source_similarity", "total"}
    assert all(0 < v < 1 for v in report["rewards"]["source_similarity"]["values"])
