"""The shipped small-world generator (models/smallworld_flux, benchmarks/smallworld_pretrain.py): it
loads into diffusers' own FluxPipeline from its directory and draws the world's objects; the adapter
samples from it exactly as that pipeline does; its config trains on the engine."""

import json
from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.algorithms.sde import sample
from digenrl.config.run import load_config
from digenrl.rewards.smallworld.detect import detect
from digenrl.rewards.smallworld.world import TAGS, split_rows

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "smallworld_flux"
CONFIG = ROOT / "configs" / "smallworld_flux.yaml"


def test_the_shipped_prompt_sets_are_the_worlds_split():
    for name, rows in zip(("train", "test"), split_rows()):
        lines = (ROOT / "configs" / "smallworld" / f"{name}_metadata.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows


def test_the_focus_set_is_four_training_captions_evaluated_eight_times_each():
    """configs/smallworld_focus (the config's prompts): one training caption of each weak category,
    rows of the world's own train split; its test split is the same rows, 8 samples each."""
    train_rows, _ = split_rows()
    focus = ROOT / "configs" / "smallworld_focus"
    rows = [json.loads(line) for line in (focus / "train_metadata.jsonl").read_text().splitlines()]
    assert all(r in train_rows for r in rows)
    assert [r["tag"] for r in rows] == ["two_object", "counting", "colors", "position"]
    test = [json.loads(line) for line in (focus / "test_metadata.jsonl").read_text().splitlines()]
    assert test == rows * 8
    assert load_config(CONFIG).prompts.file.resolve() == focus.resolve()


@pytest.fixture(scope="module")
def pipe():
    from diffusers import FluxPipeline

    p = FluxPipeline.from_pretrained(MODEL)
    p.set_progress_bar_config(disable=True)
    return p


def test_the_checkpoint_loads_into_flux_pipeline_and_draws_objects(pipe):
    """From prompt strings, through its own tokenizers and text encoders: 8 samples of 32x32 pixels in
    which the detector finds the world's objects (a random-init model draws none)."""
    prompts = ["a photo of a red circle", "a photo of two squares"] * 4
    images = pipe(
        prompt=prompts,
        num_inference_steps=16,
        height=32,
        width=32,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    assert images.shape == (8, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    found = [detect(img.permute(1, 2, 0).numpy()) for img in images]
    assert sum(bool(f) for f in found) >= 6, found
    assert sum(len(f.get("circle", [])) > 0 for f in found[::2]) >= 2  # asked for circles: circles


def test_the_adapter_samples_as_the_pipeline_does(pipe):
    cfg = load_config(CONFIG, [f"model.pretrained={MODEL}"])
    ad = build_adapter(cfg.model, cfg.sampling)
    prompts = ["a photo of a square left of a circle", "a photo of three triangles"]
    noise = ad.initial_noise(2, torch.Generator().manual_seed(3))
    ours = sample(ad, ad.cond_for(prompts), noise, ad.sigmas(6), "flow_grpo", 0.0, None).latents[:, -1]
    theirs = pipe(
        prompt=prompts,
        latents=noise.clone(),
        num_inference_steps=6,
        height=32,
        width=32,
        max_sequence_length=16,
        output_type="latent",
    ).images
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


@pytest.mark.slow
def test_two_iterations_on_the_engine(tmp_path, monkeypatch, capsys, ray_cluster):
    """`digenrl train -c configs/smallworld_flux.yaml`, 2 small iterations on the colocated engine: the
    smallworld reward scores every sample (in [0, 1]) and the LoRA trains."""
    from tests.helpers import cli

    monkeypatch.chdir(ROOT)  # the config's paths are the repository's
    sets = [
        "train.iterations=2",
        "train.prompts_per_iteration=2",
        "algorithm.group_size=4",
        "sampling.steps=4",
        "output.save_samples_every=0",
    ]
    code, out, err = cli(
        monkeypatch,
        capsys,
        "train",
        "-c",
        str(CONFIG),
        "--run-dir",
        str(tmp_path / "r"),
        *[a for s in sets for a in ("--set", s)],
    )
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    assert all(0 <= r["reward/smallworld"] <= 1 and r["samples"] == 8 for r in rows)
    assert (tmp_path / "r" / "final" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow
def test_the_pretraining_script_writes_a_pipeline_and_its_scores(tmp_path):
    """benchmarks/smallworld_pretrain.py at a tiny size: a FluxPipeline directory, the held-out score
    per category, and one probe of the curve."""
    from tests.helpers import run_benchmark_here

    small = ["--images", "64", "--vae-steps", "2", "--flow-steps", "3", "--batch", "8"]
    data = run_benchmark_here(
        "smallworld_pretrain.py",
        tmp_path,
        "--out",
        str(tmp_path / "m"),
        *small,
        *["--eval-every", "2", "--eval-seeds", "1", "--sample-steps", "2"],
    )
    assert (tmp_path / "m" / "model_index.json").is_file() and (tmp_path / "m" / "pretrain.json").is_file()
    assert set(data["eval"]["by_tag"]) == set(TAGS) and 0 <= data["eval"]["overall"] <= 1
    assert [c["step"] for c in data["curve"]] == [2] and data["command"]["flow_steps"] == 3

    # --resume: trains on from that directory, its VAE (and latent scaling) kept, its steps counted on
    more = ["--flow-steps", "2", "--decay", "--eval-every", "1", "--resume", str(tmp_path / "m")]
    again = run_benchmark_here(
        "smallworld_pretrain.py",
        tmp_path,
        *["--out", str(tmp_path / "m2"), *small[:-4], "--batch", "8", *more],
        *["--eval-seeds", "1", "--sample-steps", "2"],
    )
    assert again["flow_steps_total"] == 5 and again["resumed"]["command"]["flow_steps"] == 3
    assert [c["step"] for c in again["curve"]] == [4]  # counted from the resumed run's 3
    from diffusers import FluxPipeline

    a, b = (FluxPipeline.from_pretrained(tmp_path / d) for d in ("m", "m2"))
    assert a.vae.config.scaling_factor == b.vae.config.scaling_factor
    assert all(torch.equal(x, y) for x, y in zip(a.vae.parameters(), b.vae.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.transformer.parameters(), b.transformer.parameters()))
