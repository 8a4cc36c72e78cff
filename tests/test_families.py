"""Every model family through the whole path: CLI training, LoRA into diffusers, real-VAE decode, learning."""

import inspect
import statistics
import sys
from pathlib import Path

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.run.rundir import read_metrics
from tests.helpers import TINY_IMAGE

pytestmark = pytest.mark.slow  # Ray, subprocess or learning runs: ./dev.sh test -m "not slow" skips them

FAMILIES = {
    "flux": "configs/flux_tiny_disaggregated.yaml",  # the engine's full mode (the default run: test_train)
    "wan": "configs/wan_tiny.yaml",
    "hunyuan_video": "configs/hunyuan_tiny.yaml",
    "qwen_image": "configs/qwen_tiny.yaml",
}
SMALL = {"flux": TINY_IMAGE}


def family_pipeline(adapter):
    """The family's own diffusers pipeline around the adapter's tiny components (no text encoders)."""
    import diffusers

    cls = getattr(diffusers, adapter.pipeline_class)
    parts = {"transformer": adapter.transformer, "vae": adapter.vae, "scheduler": adapter.scheduler}
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    return cls(**{n: parts.get(n) for n in names})


def cli(monkeypatch, *argv):
    from digenrl.cli.app import main

    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_from_cli_and_lora_loads_into_the_family_pipeline(family, tmp_path, monkeypatch, ray_cluster):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from digenrl.policy.model import Policy

    sets = [f"--set={s}" for s in SMALL.get(family, [])]
    config = Path(__file__).resolve().parents[1] / FAMILIES[family]
    monkeypatch.chdir(tmp_path)  # a shipped config runs from any directory (issue 56)
    code = cli(
        monkeypatch,
        "train",
        "-c",
        str(config),
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "train.iterations=2",
        *sets,
    )
    assert code == 0
    rows = read_metrics(tmp_path / "run")
    assert [r["version"] for r in rows] == [1, 2] and all(r["reward_mean"] > 0 for r in rows)

    saved = load_file(tmp_path / "run" / "final" / "pytorch_lora_weights.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # it trained something
    cfg = load_config(config, SMALL.get(family, []))
    fresh = Policy(cfg, trainable=False).adapter
    fresh.transformer.delete_adapters("default")
    pipe = family_pipeline(fresh)
    pipe.load_lora_weights(tmp_path / "run" / "final")
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert len(loaded) == len(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k.removeprefix("transformer.")], v), k


@pytest.mark.parametrize("family", FAMILIES)
def test_real_vae_decode_path(family):
    from digenrl.adapters import build_adapter

    cfg = load_config(Path(FAMILIES[family]))
    ad = build_adapter(cfg.model, cfg.sampling)
    x = ad.initial_noise(2, torch.Generator().manual_seed(0))
    preview = ad.decode(x)
    ad.preview = None
    real = ad.decode(x)
    assert real.shape == preview.shape  # the preview decoder mirrors the VAE's output geometry
    assert real.min() >= 0 and real.max() <= 1
    n_frames = cfg.model.frames
    assert real.shape == ((2, 3, n_frames, 32, 32) if n_frames else (2, 3, 32, 32))


@pytest.mark.parametrize("family", ["wan", "hunyuan_video", "qwen_image"])
def test_family_learns(family, tmp_path):
    """A short fixed-seed run on two colours: the reward of the last third is above the first third."""
    from digenrl.engine.local import LocalTrainer

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red apple\na red car\na blue apple\na blue car\n")
    cfg = load_config(
        Path(FAMILIES[family]),
        ["train.iterations=24", f"prompts.file={prompts}", f"output.run_dir={tmp_path / 'run'}"],
    )
    rewards = [r["reward_mean"] for r in LocalTrainer(cfg).run().metrics]
    first, last = rewards[:8], rewards[-8:]
    gain = statistics.mean(last) - statistics.mean(first)
    noise = (statistics.variance(first) / 8 + statistics.variance(last) / 8) ** 0.5
    assert gain > 0.02 and gain > 2 * noise, (gain, noise, rewards)
