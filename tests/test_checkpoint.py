"""Checkpoints: exact resume, atomic writes, pruning, compatibility checks, diffusers loading, bad input."""

import json
import shutil

import pytest
import torch

from digenrl.checkpoint.compat import CheckpointError
from digenrl.checkpoint.load import load_checkpoint, read_state
from digenrl.checkpoint.store import find_checkpoint, latest_checkpoint, list_checkpoints, save_checkpoint
from digenrl.config.run import load_config
from digenrl.engine.local import LocalTrainer
from digenrl.policy.model import Policy
from digenrl.run.rundir import read_metrics
from tests.helpers import TINY, cli

# tiny FLUX, small enough that an iteration takes a fraction of a second on 2 cores
SMALL = [
    *TINY,
    "output.tensorboard=false",
]


def cfg_of(*overrides):
    return load_config(None, [*SMALL, *overrides])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 4-iteration run, and one stopped after 3 then resumed from its iteration-2
    checkpoint."""
    tmp = tmp_path_factory.mktemp("resume")
    full = LocalTrainer(
        cfg_of("train.iterations=4", "output.checkpoint_every=2", f"output.run_dir={tmp / 'a'}")
    ).run()
    # stopped after 3 iterations: checkpoints at 2 and at the end (3); metrics hold rows 0..2
    LocalTrainer(
        cfg_of("train.iterations=3", "output.checkpoint_every=2", f"output.run_dir={tmp / 'b'}")
    ).run()
    ckpt2 = tmp / "b" / "checkpoints" / "iter-000002"
    resumed_trainer = LocalTrainer(cfg_of("train.iterations=4", "output.checkpoint_every=2"), resume=ckpt2)
    assert resumed_trainer.start_iteration == 2 and resumed_trainer.policy.version == 2
    resumed = resumed_trainer.run()
    return full, resumed


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(runs):
    full, resumed = runs
    a, b = read_metrics(full.run_dir), read_metrics(resumed.run_dir)
    # the row of iteration 2 logged after the checkpoint at 2 was dropped and re-run: no duplicates
    assert [r["iteration"] for r in b] == [0, 1, 2, 3] and [r["version"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"], (ra["iteration"], ra["reward_mean"], rb["reward_mean"])
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"]
    assert [r["reward_mean"] for r in resumed.metrics] == [r["reward_mean"] for r in a]
    # same final weights, same final optimizer state
    from safetensors.torch import load_file

    wa = load_file(full.run_dir / "final" / "pytorch_lora_weights.safetensors")
    wb = load_file(resumed.run_dir / "final" / "pytorch_lora_weights.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa = torch.load(full.run_dir / "checkpoints/iter-000004/optimizer.pt", weights_only=True)
    ob = torch.load(resumed.run_dir / "checkpoints/iter-000004/optimizer.pt", weights_only=True)
    assert all(torch.equal(oa["state"][i]["exp_avg_sq"], ob["state"][i]["exp_avg_sq"]) for i in oa["state"])


@pytest.mark.slow
def test_checkpoint_layout(runs):
    full, _ = runs
    assert [p.name for p in list_checkpoints(full.run_dir)] == ["iter-000002", "iter-000004"]
    ckpt = latest_checkpoint(full.run_dir)
    assert ckpt.name == "iter-000004"
    names = {p.name for p in ckpt.iterdir()}
    assert names == {
        "pytorch_lora_weights.safetensors",
        "optimizer.pt",
        "rng.pt",
        "config.yaml",
        "state.json",
    }
    state = json.loads((ckpt / "state.json").read_text())
    assert state["iteration"] == 4 and state["version"] == 4 and state["format"] == 1
    assert state["model_signature"]["class"] == "FluxTransformer2DModel"
    assert load_config(ckpt / "config.yaml").train.iterations == 4


@pytest.mark.slow
def test_resume_of_a_finished_run_just_returns(runs, monkeypatch, capsys):
    full, _ = runs
    before = (full.run_dir / "metrics.jsonl").read_text()
    result = LocalTrainer(cfg_of("train.iterations=4"), resume=full.run_dir).run()
    assert len(result.metrics) == 4 and (full.run_dir / "metrics.jsonl").read_text() == before
    code, out, _ = cli(monkeypatch, capsys, "train", "--resume", str(full.run_dir))
    assert code == 0 and "nothing to do" in out
    assert (full.run_dir / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_lora_checkpoint_loads_into_flux_pipeline_and_reproduces_the_sampler(runs):
    """The diffusers pipeline with the checkpoint's LoRA gives the trained policy's own ODE sample."""
    from diffusers import FluxPipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from digenrl.algorithms.sde import sample

    full, _ = runs
    ckpt = latest_checkpoint(full.run_dir)
    cfg = load_config(ckpt / "config.yaml")
    trained = Policy(cfg, trainable=False)
    load_checkpoint(ckpt, trained, optimizer=False, rng=False)
    ad = Policy(cfg, trainable=False).adapter
    ad.transformer.delete_adapters("default")
    pipe = FluxPipeline(
        scheduler=ad.scheduler,
        vae=ad.vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=ad.transformer,
    )
    pipe.load_lora_weights(ckpt)
    saved = load_file(ckpt / "pytorch_lora_weights.safetensors")
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=pipe.transformer.active_adapters()[0])
    assert len(loaded) == len(saved) and any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)
    for k, v in saved.items():
        assert torch.equal(loaded[k.removeprefix("transformer.")], v), k

    cond = ad.encode_prompts(["a red car"])
    noise = ad.initial_noise(1, torch.Generator().manual_seed(0))
    out = pipe(
        prompt_embeds=cond.batched["prompt_embeds"],
        pooled_prompt_embeds=cond.batched["pooled"],
        latents=noise.clone(),
        num_inference_steps=6,
        height=16,
        width=16,
        guidance_scale=cfg.sampling.guidance,
        output_type="latent",
    ).images
    ours = sample(trained.adapter, cond, noise, trained.adapter.sigmas(6), "flow_grpo", 0.0).latents[:, -1]
    torch.testing.assert_close(out, ours, rtol=1e-4, atol=1e-5)  # LoRA alpha travels with the file


def test_crash_mid_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    cfg = cfg_of("train.iterations=2", f"output.run_dir={tmp_path}")
    policy = Policy(cfg)
    save_checkpoint(tmp_path, policy, 1, cfg)
    real_save = torch.save

    def crash(obj, f, *a, **k):
        if str(f).endswith("rng.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr("digenrl.checkpoint.store.torch.save", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, policy, 2, cfg)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert (root / ".tmp-iter-000002").is_dir() and not (root / "iter-000002").exists()
    # a renamed directory without its completion marker is not a checkpoint either
    shutil.copytree(root / ".tmp-iter-000002", root / "iter-000003")
    assert latest_checkpoint(tmp_path).name == "iter-000001"
    with pytest.raises(CheckpointError, match="incomplete"):
        find_checkpoint(root / "iter-000003")
    shutil.rmtree(root / "iter-000003")
    # the previous checkpoint is usable: resume from the run directory trains the remaining iteration
    result = LocalTrainer(cfg, resume=tmp_path).run()
    assert [r["iteration"] for r in result.metrics] == [1]
    assert sorted(p.name for p in root.iterdir()) == ["iter-000001", "iter-000002"]  # the .tmp- dir is gone


def test_keep_last_prunes_the_oldest(tmp_path):
    cfg = cfg_of()
    policy = Policy(cfg)
    for it in range(1, 6):
        save_checkpoint(tmp_path, policy, it, cfg, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter-000004", "iter-000005"]


def test_full_finetuning_checkpoint_round_trip(tmp_path):
    import random

    import numpy as np

    cfg = cfg_of("model.lora=null")
    policy = Policy(cfg)
    for p in policy.params:
        p.grad = torch.randn_like(p) * 1e-3
    policy.optimizer_step()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    ckpt = save_checkpoint(tmp_path, policy, 1, cfg)
    assert (ckpt / "transformer.safetensors").is_file() and not (
        ckpt / "pytorch_lora_weights.safetensors"
    ).exists()
    draws = torch.rand(3), random.random(), np.random.rand()

    fresh = Policy(cfg)
    state = load_checkpoint(tmp_path, fresh)
    assert state.iteration == 1 and fresh.version == 1
    assert all(torch.equal(a, b) for a, b in zip(policy.weights().values(), fresh.weights().values()))
    sa, sb = policy.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    again = torch.rand(3), random.random(), np.random.rand()  # RNG states restored
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.lora.rank=4"], "model.lora.rank: checkpoint 8, config 4"),
        (["model.height=32"], "model.height: checkpoint 16, config 32"),
        (["model.lora=null"], "model.lora: checkpoint 'lora', config 'full fine-tuning'"),
        (["model.lora.targets=[to_q, to_k]"], "model.lora.targets"),
    ],
)
def test_incompatible_checkpoint_is_refused_naming_the_difference(tmp_path, overrides, needle):
    cfg = cfg_of()
    save_checkpoint(tmp_path, Policy(cfg), 1, cfg)
    other = Policy(cfg_of(*overrides))
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(tmp_path, other)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert other.version == 0  # refused before anything was loaded


@pytest.mark.slow
def test_checkpoint_of_another_adapter_is_refused_from_the_cli(runs, tmp_path, monkeypatch, capsys):
    full, _ = runs
    before = (full.run_dir / "metrics.jsonl").read_text()
    code, _, err = cli(
        monkeypatch,
        capsys,
        "train",
        "--resume",
        str(full.run_dir),
        "-c",
        "configs/qwen_tiny.yaml",
        "--set",
        "train.iterations=6",
    )
    assert code == 2 and "model.adapter: checkpoint 'flux', config 'qwen_image'" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (full.run_dir / "metrics.jsonl").read_text() == before  # nothing written


@pytest.fixture
def copied(runs, tmp_path):
    """A writable copy of a complete checkpoint, to damage."""
    full, _ = runs
    dst = tmp_path / "run" / "checkpoints" / "iter-000004"
    shutil.copytree(latest_checkpoint(full.run_dir), dst)
    return dst


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("truncate optimizer.pt", "optimizer.pt has"),
        ("truncate state.json", "state.json is corrupt"),
        ("garble optimizer.pt", "optimizer.pt is corrupt"),
        ("delete rng.pt", "rng.pt is missing"),
    ],
)
@pytest.mark.slow
def test_corrupt_checkpoint_exits_2(copied, monkeypatch, capsys, damage, needle):
    verb, name = damage.split()
    f = copied / name
    if verb == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif verb == "garble":
        f.write_bytes(b"\0" * f.stat().st_size)
    else:
        f.unlink()
    code, _, err = cli(
        monkeypatch, capsys, "train", "--resume", str(copied.parent.parent), "--set", "train.iterations=6"
    )
    assert code == 2 and needle in err and err.count("\n") == 1, err
    assert not (copied.parent.parent / "metrics.jsonl").exists()  # nothing half-written


def test_a_directory_that_is_no_checkpoint_says_what_it_is(tmp_path):
    """A run's final/ (weights only) is named as an export; any other directory by what it holds."""
    from digenrl.checkpoint.store import LORA_FILE

    (tmp_path / "final").mkdir()
    (tmp_path / "final" / LORA_FILE).write_bytes(b"x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(
        CheckpointError, match="final is a weights export .* --resume needs the run directory"
    ):
        find_checkpoint(tmp_path / "final")
    with pytest.raises(CheckpointError, match="it is neither a checkpoint .* it holds notes.txt$"):
        find_checkpoint(tmp_path / "other")


@pytest.mark.parametrize(
    "target, needle",
    [
        ("{tmp}/missing", "missing not found"),
        ("{tmp}", "no complete checkpoint in"),
    ],
)
def test_resume_without_a_checkpoint_exits_2(tmp_path, monkeypatch, capsys, target, needle):
    code, _, err = cli(monkeypatch, capsys, "train", "--resume", target.replace("{tmp}", str(tmp_path)))
    assert code == 2 and needle in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_read_state_reports_counters(runs):
    full, _ = runs
    state = read_state(latest_checkpoint(full.run_dir))
    assert (state.iteration, state.version, state.lora) == (4, 4, True) and state.run_dir == full.run_dir
