"""``digenrl eval`` on a checkpoint of every family, baselines, periodic eval, TensorBoard / W&B logging, bad
input."""

import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from digenrl.config.run import load_config
from digenrl.engine.local import LocalTrainer
from digenrl.run.rundir import RunDir, read_metrics
from tests.helpers import TINY_IMAGE, cli

pytestmark = pytest.mark.slow  # Ray, subprocess or learning runs: ./dev.sh test -m "not slow" skips them

FAMILIES = {
    "flux": ("configs/flux_tiny.yaml", TINY_IMAGE),
    "wan": ("configs/wan_tiny.yaml", []),
    "hunyuan_video": ("configs/hunyuan_tiny.yaml", []),
    "qwen_image": ("configs/qwen_tiny.yaml", []),
}
# one quick iteration: 1 prompt x 2 samples x 2 steps; eval with 4 ODE steps
QUICK = [
    "train.prompts_per_iteration=1",
    "algorithm.group_size=2",
    "sampling.steps=2",
    "sampling.eval_steps=4",
    "output.tensorboard=false",
]


def train(family, run_dir, *extra):
    path, sets = FAMILIES[family]
    cfg = load_config(Path(path), [*sets, *QUICK, f"output.run_dir={run_dir}", *extra])
    return LocalTrainer(cfg).run()


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "eval.txt"
    f.write_text("a red car\na green bird\na blue boat\na yellow house\n")
    return f


@pytest.fixture(scope="module")
def flux_run(tmp_path_factory):
    """Tiny FLUX, 2 iterations, a checkpoint after each."""
    return train(
        "flux", tmp_path_factory.mktemp("flux") / "run", "train.iterations=2", "output.checkpoint_every=1"
    ).run_dir


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_a_checkpoint_of_each_family_against_base(family, tmp_path, prompt_file, monkeypatch, capsys):
    run = train(family, tmp_path / "run", "train.iterations=1").run_dir
    code, out, err = cli(
        monkeypatch,
        capsys,
        "eval",
        "--checkpoint",
        str(run),
        "--prompts",
        str(prompt_file),
        "--baseline",
        "base",
    )
    assert code == 0, err
    out_dir = run / "eval" / "iter-000001"  # the default output directory
    report = json.loads((out_dir / "eval.json").read_text())
    assert report["adapter"] == family and report["eval_steps"] == 4 and report["iteration"] == 1
    assert report["prompts"] == prompt_file.read_text().split("\n")[:4]
    for rewards in (report["rewards"], report["baseline"]["rewards"]):
        assert set(rewards) == {"prompt_color", "total"}
        r = rewards["prompt_color"]
        assert len(r["values"]) == 4 and 0 < r["mean"] < 1 and r["std"] >= 0
    d = report["difference"]["prompt_color"]
    assert d == pytest.approx(
        report["rewards"]["prompt_color"]["mean"] - report["baseline"]["rewards"]["prompt_color"]["mean"]
    )
    ext = ".gif" if family in ("wan", "hunyuan_video") else ".png"
    assert report["grid"] == f"eval{ext}" and report["comparison"] == f"compare{ext}"
    assert (out_dir / f"eval{ext}").stat().st_size > 0 and (out_dir / f"compare{ext}").stat().st_size > 0
    assert "prompt_color" in out and "difference" in out  # the rich table
    if ext == ".gif":
        from PIL import Image

        assert Image.open(out_dir / "eval.gif").n_frames > 1  # animated (Pillow merges repeated frames)


def test_baseline_checkpoint_same_noise_and_every_reward(
    flux_run, tmp_path, prompt_file, monkeypatch, capsys
):
    ckpts = flux_run / "checkpoints"
    # a config with two rewards: every configured reward is scored
    cfg = load_config(ckpts / "iter-000002" / "config.yaml")
    data = cfg.model_dump(mode="json")
    data["reward"]["components"].append({"name": "jpeg_compressibility", "weight": 0.01, "args": {}})
    two = tmp_path / "two.yaml"
    two.write_text(json.dumps(data))
    code, _, err = cli(
        monkeypatch,
        capsys,
        "eval",
        "--checkpoint",
        str(ckpts / "iter-000002"),
        "--config",
        str(two),
        "--prompts",
        str(prompt_file),
        "--baseline",
        str(ckpts / "iter-000001"),
        "--out",
        str(tmp_path / "vs1"),
    )
    assert code == 0, err
    report = json.loads((tmp_path / "vs1" / "eval.json").read_text())
    assert set(report["rewards"]) == {"prompt_color", "jpeg_compressibility", "total"}
    assert report["baseline"]["source"].endswith("iter-000001") and report["version"] == 2
    assert any(
        report["difference"][k] != 0 for k in report["difference"]
    )  # different weights, different images
    # against itself: same weights and the same fixed noise per prompt -> identical values
    code, _, _ = cli(
        monkeypatch,
        capsys,
        "eval",
        "--checkpoint",
        str(ckpts / "iter-000002"),
        "--prompts",
        str(prompt_file),
        "--baseline",
        str(ckpts / "iter-000002"),
        "--out",
        str(tmp_path / "self"),
    )
    same = json.loads((tmp_path / "self" / "eval.json").read_text())
    assert code == 0 and all(v == 0 for v in same["difference"].values())
    assert same["rewards"]["prompt_color"]["values"] == same["baseline"]["rewards"]["prompt_color"]["values"]
    assert same["rewards"]["prompt_color"] == report["rewards"]["prompt_color"]  # deterministic across calls


def test_periodic_eval_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(
        "flux", tmp_path / "run", "train.iterations=2", "output.eval_every=2", "output.tensorboard=true"
    )
    rows = read_metrics(run.run_dir)
    assert "eval/prompt_color" not in rows[0] and 0 < rows[1]["eval/prompt_color"] < 1
    assert rows[1]["eval/reward_mean"] == rows[1]["eval/prompt_color"]
    events = EventAccumulator(str(run.run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in (
        "reward_mean",
        "reward_std",
        "loss",
        "kl",
        "ratio_mean",
        "clip_frac",
        "samples_per_s",
        "grad_norm",
        "reward/prompt_color",
        "eval/prompt_color",
    ):
        assert key in tags, key
    assert (
        "bubble_fraction" not in tags and "bubble_fraction" not in rows[0]
    )  # a local run measures no bubble
    assert [e.step for e in events.Scalars("loss")] == [0, 1]
    assert events.Scalars("reward_mean")[1].value == pytest.approx(rows[1]["reward_mean"])


def test_wandb_only_when_enabled_and_importable(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw["id"])) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    row = {"iteration": 3, "version": 4, "reward_mean": 0.5, "note": "x", "ok": True}
    for enabled in (False, True):
        cfg = load_config(None, ["output.tensorboard=false", f"output.wandb={str(enabled).lower()}"])
        out = RunDir(cfg, tmp_path / str(enabled))
        out.log(row)
        out.close()
    assert [c[0] for c in calls] == ["init", "log", "finish"]
    assert calls[1] == ("log", 3, {"version": 4.0, "reward_mean": 0.5})
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: a warning, never an error
    out = RunDir(load_config(None, ["output.tensorboard=false", "output.wandb=true"]), tmp_path / "none")
    out.log(row)
    out.close()


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing", "not found"),
        ("no checkpoint", "no complete checkpoint in"),
        ("corrupt", "optimizer.pt has"),
        ("empty prompts", "holds no prompts"),
        ("prompts not UTF-8", "latin1.txt is not UTF-8 text"),
        ("out is a run's file", "is not writable"),
        ("out is under a file", "is not writable"),
        ("missing baseline", "nope not found"),
        ("no --checkpoint", "--checkpoint: required"),
    ],
)
def test_eval_bad_input_exits_2_with_one_line(case, needle, flux_run, tmp_path, monkeypatch, capsys):
    ckpt = flux_run / "checkpoints" / "iter-000002"
    out = tmp_path / "out"
    args = ["--checkpoint", str(ckpt), "--out", str(out)]
    if case == "missing":
        args[1] = str(tmp_path / "gone")
    elif case == "no checkpoint":
        (tmp_path / "empty-run").mkdir()
        args[1] = str(tmp_path / "empty-run")
    elif case == "corrupt":
        bad = tmp_path / "bad" / "checkpoints" / "iter-000002"
        shutil.copytree(ckpt, bad)
        (bad / "optimizer.pt").write_bytes(b"x")
        args[1] = str(bad)
    elif case == "empty prompts":
        (tmp_path / "empty.txt").write_text("\n\n")
        args += ["--prompts", str(tmp_path / "empty.txt")]
    elif case == "prompts not UTF-8":
        (tmp_path / "latin1.txt").write_bytes(b"a red caf\xe9\n")
        args += ["--prompts", str(tmp_path / "latin1.txt")]
    elif case == "out is a run's file":
        out = flux_run / "metrics.jsonl"
        before = out.read_bytes()
        args[3] = str(out)
    elif case == "out is under a file":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "out"
        args[3] = str(out)
    elif case == "missing baseline":
        args += ["--baseline", str(tmp_path / "nope")]
    elif case == "no --checkpoint":
        args = args[2:]
    code, _, err = cli(monkeypatch, capsys, "eval", *args)
    assert code == 2 and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    if case == "out is a run's file":
        assert out.read_bytes() == before  # nothing changed
    else:
        assert not out.exists()  # nothing half-written


def test_eval_on_a_flow_grpo_directory_reads_its_test_split_and_reports_means_per_tag(
    flux_run, tmp_path, monkeypatch, capsys
):
    """A dataset directory (Flow-GRPO's layout) is evaluated on its held-out ``test`` split; GenEval-style
    tags give each reward's mean per tag and their mean (GenEval's overall score) in eval.json."""
    data = tmp_path / "geneval"
    data.mkdir()
    rows = [("a red car", "colors"), ("a blue boat", "colors"), ("a green bird", "single_object")]
    (data / "test_metadata.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "tag": t}) + "\n" for p, t in rows)
    )
    (data / "train_metadata.jsonl").write_text(json.dumps({"prompt": "a train prompt", "tag": "x"}) + "\n")
    ckpt = flux_run / "checkpoints" / "iter-000002"
    code, out, err = cli(
        monkeypatch,
        capsys,
        "eval",
        "--checkpoint",
        str(ckpt),
        "--prompts",
        str(data),
        "--out",
        str(tmp_path / "e"),
    )
    assert code == 0, err
    assert "single_object" in out and "mean of tags" in out  # the printed table: a row per tag
    report = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert report["prompts"] == [p for p, _ in rows]  # the test split, not train
    r = report["rewards"]["prompt_color"]
    colors, single = (r["values"][0] + r["values"][1]) / 2, r["values"][2]
    assert r["by_tag"] == pytest.approx({"colors": colors, "single_object": single}, abs=1e-5)
    assert r["tag_mean"] == pytest.approx((colors + single) / 2, abs=1e-5)
    assert r["mean"] == pytest.approx(sum(r["values"]) / 3, abs=1e-5)


def test_eval_of_a_runs_lora_export_equals_its_last_checkpoint(flux_run, tmp_path, monkeypatch, capsys):
    """`eval --checkpoint RUN/final` (the LoRA export, no state.json) works, with the run's config, and
    scores what the last checkpoint (the same weights, no EMA) scores; so does the .safetensors path."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red apple\na blue car\n")
    reports = []
    for target in ("final", "checkpoints/iter-000002", "final/pytorch_lora_weights.safetensors"):
        out = tmp_path / target.replace("/", "_")
        code, _, err = cli(
            monkeypatch,
            capsys,
            "eval",
            "--checkpoint",
            str(flux_run / target),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
        )
        assert code == 0, err
        reports.append(json.loads((out / "eval.json").read_text()))
    export, last, by_file = reports
    assert export["rewards"] == last["rewards"] == by_file["rewards"]
    assert export["version"] is None and last["version"] == 2
