"""Every bad input a user can cause: one line on stderr naming the field or file, exit code 2,
no traceback, nothing written. The same list is the table in docs/errors.md."""

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import pytest

from digenrl.cli.app import main
from digenrl.placement.preflight import CPU_DEVICES_PER_CORE
from tests.helpers import FULL_MODE_SETS, TINY, TINY_IMAGE, TINY_SETS, as_sets, ray_tmpdir


def cli(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


def make_inputs(tmp):
    from digenrl.planner.constants import PROFILE_VERSION

    (tmp / "bad.yaml").write_text("train:\n  iterations: [1\n")
    (tmp / "latin1.yaml").write_bytes(b"train:\n  lr: 0.1  # caf\xe9\n")
    (tmp / "latin1.txt").write_bytes(b"a red caf\xe9\n")
    (tmp / "dup.yaml").write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    (tmp / "adir").mkdir()
    (tmp / "h100.json").write_text(
        json.dumps(
            {
                "version": PROFILE_VERSION,
                "device": {"kind": "gpu", "name": "NVIDIA H100 80GB HBM3", "table_key": "H100"},
                "model": {},
                "measurements": {},
                "workload": {},
            }
        )
    )
    (tmp / "empty.txt").write_text("\n\n")
    (tmp / "partial").mkdir()
    (tmp / "partial" / "config.yaml").write_text("")
    (tmp / "rec.yaml").write_text("train: &x\n  lr: *x\n")
    (tmp / "unk.yaml").write_text("train:\n  lr_max: 1\n")
    (tmp / "num.jsonl").write_text('{"prompt": "a red car"}\n{"prompt": 5}\n')
    (tmp / "array.jsonl").write_text('["make it red", "images/ok.png"]\n')  # crashed with a TypeError
    (tmp / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "a red car"}\n')
    (tmp / "cut.jsonl").write_text('{"prompt": "a red car"}\n{"prompt": "a blue\n')
    (tmp / "nul.txt").write_text("a red car\na blue\0boat\n")
    (tmp / "tag.yaml").write_text("train: !!python/object:os.system x\n")
    make_edit_inputs(tmp)
    return tmp


def make_edit_inputs(tmp):
    """Edit prompt sets (FLUX.1 Kontext at the default 32x32): a missing, an unreadable (a PNG cut short)
    and a wrong-size input image, each on row 2 after a good one; a row with no image."""
    from PIL import Image

    (tmp / "img").mkdir()
    Image.new("RGB", (32, 32), (200, 0, 0)).save(tmp / "img" / "ok.png")
    Image.new("RGB", (32, 24), (0, 0, 200)).save(tmp / "img" / "small.png")
    (tmp / "img" / "cut.png").write_bytes((tmp / "img" / "ok.png").read_bytes()[:40])
    good = json.dumps({"prompt": "make it blue", "image": "img/ok.png"})
    for name, row in [
        ("missing", {"prompt": "make it red", "image": "img/none.png"}),
        ("cut", {"prompt": "make it red", "image": "img/cut.png"}),
        ("small", {"prompt": "make it red", "image": "img/small.png"}),
        ("noimage", {"prompt": "make it red"}),
    ]:
        (tmp / f"edit_{name}.jsonl").write_text(f"{good}\n{json.dumps(row)}\n")


def write_big_prompt(tmp: Path) -> None:
    """A prompt file whose second line is 10 MB (what crashed Pillow 20 s into a run)."""
    with open(tmp / "big.txt", "w") as f:
        f.write("a red car\n" + "a red apple " * 900_000 + "\n")


#: the edit cases' family (the default run's size, 32x32)
KONTEXT_SETS = as_sets(["model.adapter=flux_kontext", "model.lora.targets=null"])
#: one logical CPU device more than this host may run (the limit scales with its cores)
MANY = CPU_DEVICES_PER_CORE * (os.cpu_count() or 1)
CASES = {
    "malformed YAML": (["train", "-c", "{t}/bad.yaml"], "bad.yaml: malformed YAML at line"),
    "unknown key": (["train", "--set", "train.lr_max=1"], "train.lr_max: unknown key"),
    "negative size": (["train", "--set", "train.prompts_per_iteration=-4"], "train.prompts_per_iteration"),
    "zero size": (["train", "--set", "model.lora.rank=0"], "model.lora.rank"),
    "no stall timeout": (["train", "--set", "engine.stall_timeout_s=0"], "engine.stall_timeout_s"),
    "group size 1": (["train", "--set", "algorithm.group_size=1"], "algorithm.group_size"),
    "groups do not divide into units": (["train", "--set", "engine.unit_groups=3"], "engine.unit_groups"),
    "mini-batches that do not divide a group": (
        ["train", "--set", "train.optimizer_steps=3"],
        "train.optimizer_steps (3) must divide algorithm.group_size",
    ),
    "unit_samples does not divide G": (["train", "--set", "engine.unit_samples=3"], "engine.unit_samples"),
    "one-step async on the colocated default": (
        ["train", "--set", "placement.mode=colocated", "--set", "engine.max_staleness=1"],
        "engine.max_staleness (1, one-step async) needs placement.mode disaggregated",
    ),
    "unit_samples with unit_groups > 1": (
        ["train", "--set", "engine.unit_samples=4", "--set", "engine.unit_groups=2"],
        "engine.unit_samples",
    ),
    "KL reference at rollout with full fine-tuning": (
        ["train", "--set", "algorithm.kl_reference=rollout", "--set", "model.lora=null"],
        "algorithm.kl_reference: rollout needs LoRA (model.lora)",
    ),
    "KL reference at rollout with a forward-process loss": (
        ["train", "--set", "algorithm.kl_reference=rollout", "--set", "algorithm.name=diffusion_nft"],
        "algorithm.kl_reference: rollout needs a Flow-GRPO-family loss; algorithm.name diffusion_nft",
    ),
    "LoRA targets matching no module": (
        ["train", *TINY_SETS, "--set", "model.lora.targets=[to_qkv]"],
        "model.lora.targets: ['to_qkv'] match no linear module",
    ),
    "missing checkpoint directory (model)": (["train", "--set", "model.pretrained={t}/nope"], "{t}/nope"),
    "missing checkpoint (resume)": (["train", "--resume", "{t}/no-run"], "no-run"),
    "run without a complete checkpoint": (["train", "--resume", "{t}/partial"], "partial"),
    "missing checkpoint (eval)": (["eval", "--checkpoint", "{t}/no-ckpt"], "no-ckpt"),
    "missing reward weights directory": (
        ["train", *TINY_SETS, "--set", "reward.components=[{name: clipscore, args: {path: {t}/no-clip}}]"],
        "no-clip",
    ),
    "unknown reward": (["train", "--set", "reward.components=[{name: hpsv9}]"], "unknown reward 'hpsv9'"),
    "empty prompt file": (["train", "--set", "prompts.file={t}/empty.txt"], "empty.txt holds no prompts"),
    "missing prompt file": (["train", "--set", "prompts.file={t}/none.txt"], "none.txt not found"),
    "unknown adapter": (["train", "--set", "model.adapter=sdxl"], "unknown adapter 'sdxl'"),
    "resolution the model cannot take": (["train", "--set", "model.height=18"], "model.height"),
    # files that are not UTF-8 text, a duplicate key
    "config file not UTF-8": (
        ["train", "-c", "{t}/latin1.yaml"],
        "--config: {t}/latin1.yaml is not UTF-8 text",
    ),
    "prompt file not UTF-8": (
        ["train", "--set", "prompts.file={t}/latin1.txt"],
        "prompts.file: {t}/latin1.txt is not UTF-8 text",
    ),
    "cluster file not UTF-8": (
        ["plan", "--cluster", "{t}/latin1.txt"],
        "--cluster: {t}/latin1.txt is not UTF-8",
    ),
    "profile not UTF-8": (["plan", "--profile", "{t}/latin1.txt"], "--profile: {t}/latin1.txt is not UTF-8"),
    "duplicate YAML key": (
        ["train", "-c", "{t}/dup.yaml"],
        "dup.yaml: key 'lr' appears twice in one mapping",
    ),
    # numbers that are not finite or absurd, a host too small, a name that leaves runs/
    "infinite learning rate": (
        ["train", "--set", "train.lr=inf"],
        "train.lr: Input should be a finite number",
    ),
    "NaN guidance": (
        ["config", "validate", "--set", "sampling.guidance=.nan"],
        "sampling.guidance: Input should be",
    ),
    "absurd step count": (
        ["train", "--set", "sampling.steps=100000"],
        "sampling.steps: Input should be less than or equal to 1000",
    ),
    "more CPU devices than the host runs": (
        ["train", "--set", f"cluster.pools=[{{name: rollout, count: {MANY}}}, {{name: trainer}}]"],
        f"cluster.pools: {MANY + 1} logical CPU devices on a host with",
    ),
    "run name leaving runs/": (
        ["train", "--set", "output.name=../../../x"],
        "output.name: must be a plain name",
    ),
    "unknown weight-sync transport": (
        ["train", "--set", "engine.weight_sync=nccl"],
        "engine.weight_sync: Input should be 'auto', 'broadcast' or 'object_store'",
    ),
    "an ocr prompt quoting no text": (  # the dry run before training reads the colour prompts
        ["train", "--set", "reward.components=[{name: ocr}]"],
        "reward.components.0: reward 'ocr' failed in its dry run on 2 random samples",
    ),
    "a geneval prompt without GenEval metadata": (
        [
            "train",
            "--set",
            "reward.components=[{name: geneval, args: {url: 'http://127.0.0.1:9/d', retries: 0}}]",
        ],
        "has no GenEval metadata",
    ),
    # usage errors: the project's one line, not Click's box
    "unknown flag": (["train", "--frobnicate"], "error: --frobnicate: no such option of `digenrl train`"),
    "flag without its value": (["eval", "--out"], "error: --out: needs a value"),
    "not an integer": (["plan", "--top", "x"], "error: --top: "),
    "unknown command": (["trian"], "error: digenrl: no such command 'trian'"),
    "--quiet with --verbose": (["train", "-q", "-v"], "--quiet and --verbose: choose one"),
    # output paths checked before the work
    "profile --out is a directory": (
        ["profile", "--out", "{t}/adir"],
        "--out: {t}/adir is a directory; name a file",
    ),
    "plan --write is a directory": (["plan", "--write", "{t}/adir"], "--write: {t}/adir is a directory"),
    "plan --write not writable": (["plan", "--write", "/proc/digenrl-plan.yaml"], "--write: /proc"),
    "plan --profile of a device type the cluster lacks": (
        ["plan", "--profile", "{t}/h100.json"],
        "--profile: measured on H100",
    ),
    # the preflight: what train rejects, config validate rejects too
    "validate: LoRA targets": (
        ["config", "validate", "--set", "model.lora.targets=[to_qkv]"],
        "model.lora.targets: ['to_qkv'] match no linear module",
    ),
    "validate: resolution": (["config", "validate", "--set", "model.height=18"], "model.height"),
    "validate: missing prompt file": (
        ["config", "validate", "--set", "prompts.file={t}/none.txt"],
        "none.txt not found",
    ),
    "validate: unknown preset": (
        ["config", "validate", "--set", "model.preset=huge"],
        "model.preset: unknown preset",
    ),
    "validate: host too small": (
        ["config", "validate", "--set", f"cluster.pools.0.count={MANY}"],
        f"cluster.pools: {MANY + 1} logical",
    ),
    "validate: missing checkpoint": (
        ["config", "validate", "--set", "model.pretrained={t}/nope"],
        "{t}/nope",
    ),
    # issue 25: inputs that crashed later are refused at load time; messages name what the user typed
    "10 MB prompt line": (
        ["train", "--set", "prompts.file={t}/big.txt"],
        "prompts.file: {t}/big.txt:2: a prompt of 10799999 characters, more than the 1024",
    ),
    "validate: 10 MB prompt line": (
        ["config", "validate", "--set", "prompts.file={t}/big.txt"],
        "prompts.file: {t}/big.txt:2: a prompt of 10799999 characters",
    ),
    "a JSONL prompt that is not a string": (
        ["train", "--set", "prompts.file={t}/num.jsonl"],
        "prompts.file: {t}/num.jsonl:2: 'prompt' must be a non-empty string",
    ),
    "prompt file that is a directory": (
        ["train", "--set", "prompts.file={t}/adir"],
        "prompts.file: {t}/adir is a directory, not a file",
    ),
    "cluster file that is a directory": (
        ["plan", "--cluster", "{t}/adir"],
        "--cluster: {t}/adir is a directory",
    ),
    "every reward weight 0": (
        ["train", "--set", "reward.components=[{name: prompt_color, weight: 0}]"],
        "reward.components: every reward weight is 0, so the run would learn nothing",
    ),
    "validate: every reward weight 0": (
        ["config", "validate", "--set", "reward.components=[{name: prompt_color, weight: 0.0}]"],
        "reward.components: every reward weight is 0",
    ),
    "profile: one CPU-sharing worker": (
        ["profile", "--cpu-sharing", "1"],
        "--cpu-sharing: 0 (skip) or at least 2 workers, got 1",
    ),
    "a reward that is not a judge on the cluster": (
        ["config", "validate", "--set", "reward.components=[{name: prompt_color, server: cluster}]"],
        "reward.components.0: server: cluster is for a judge served beside the run",
    ),
    "recursive YAML anchor": (
        ["config", "validate", "-c", "{t}/rec.yaml"],
        "{t}/rec.yaml: a recursive YAML anchor (an alias used inside its own anchor) at line 1",
    ),
    "a NUL in a prompt": (
        ["train", "--set", "prompts.file={t}/nul.txt"],
        "prompts.file: {t}/nul.txt:2: the prompt holds a NUL character",
    ),
    "a YAML tag SafeLoader refuses": (
        ["train", "-c", "{t}/tag.yaml"],
        "{t}/tag.yaml: unsupported YAML at line 1, column 8 (could not determine a constructor",
    ),
    "a pool name that is not a plain name": (
        ["train", "--set", "cluster.pools=[{name: 'rollout pool'}, {name: trainer}]"],
        "cluster.pools.0.name: a pool name is 1-64 letters, digits, '_', '.' or '-' (got 'rollout pool')",
    ),
    "unknown key in a -c file": (
        ["train", "-c", "{t}/unk.yaml"],
        "error: {t}/unk.yaml: train.lr_max: unknown key",
    ),
    "a missing input image": (
        ["train", *KONTEXT_SETS, "--set", "prompts.file={t}/edit_missing.jsonl"],
        "prompts.file: {t}/edit_missing.jsonl:2: image not found: {t}/img/none.png",
    ),
    "an unreadable input image": (
        ["config", "validate", *KONTEXT_SETS, "--set", "prompts.file={t}/edit_cut.jsonl"],
        "prompts.file: {t}/edit_cut.jsonl:2: image unreadable: {t}/img/cut.png",
    ),
    "an input image of the wrong size": (
        ["train", *KONTEXT_SETS, "--set", "prompts.file={t}/edit_small.jsonl"],
        "prompts.file: {t}/edit_small.jsonl:2: image {t}/img/small.png is 24x32, the model generates 32x32",
    ),
    "an edit row with no input image": (
        ["train", *KONTEXT_SETS, "--set", "prompts.file={t}/edit_noimage.jsonl"],
        "prompts.file: {t}/edit_noimage.jsonl:2: model.adapter flux_kontext edits an input image: "
        "the row has no 'image'",
    ),
    "an edit family on a prompt set without images": (
        ["train", *KONTEXT_SETS],
        "prompts.builtin: model.adapter flux_kontext edits images: give prompts.file, a .jsonl",
    ),
    # issue 56: every malformed prompt row says what is wrong; a model reward's files checked before Ray
    "a JSONL row that is an array": (
        ["train", "--set", "prompts.file={t}/array.jsonl"],
        "prompts.file: {t}/array.jsonl:1: a JSON array, not an object with a 'prompt' field",
    ),
    "a JSONL file with a byte-order mark": (
        ["train", "--set", "prompts.file={t}/bom.jsonl"],
        "prompts.file: {t}/bom.jsonl:1: starts with a UTF-8 byte-order mark (BOM)",
    ),
    "a JSONL row cut short": (
        ["train", "--set", "prompts.file={t}/cut.jsonl"],
        "prompts.file: {t}/cut.jsonl:2: invalid JSON at column 12 (Unterminated string",
    ),
    "an hpsv2 checkpoint that does not exist": (
        ["train", "--set", "reward.components=[{name: hpsv2, args: {path: {t}/no.pt, tokenizer: {t}/adir}}]"],
        "reward.components.0.args.path: reward 'hpsv2': checkpoint file {t}/no.pt not found",
    ),
    "an argument a model reward does not take": (
        ["train", "--set", "reward.components=[{name: pickscore, args: {path: {t}/adir, sizee: 2}}]"],
        "reward.components.0.args: reward 'pickscore': got an unexpected keyword argument 'sizee'",
    ),
    "a run name too long for a file name": (
        ["train", "--set", f"output.name={'x' * 300}"],
        "output.name: must be a name of at most 200 bytes (got 300)",
    ),
}
try:
    import torch

    if not torch.cuda.is_available():  # the profiler's own option, not train.device
        CASES["profile --device cuda without CUDA"] = (
            ["profile", "--device", "cuda", "--out", "{t}/p.json"],
            "error: --device: cuda requested but no CUDA device is visible",
        )
except ImportError:
    pass


def full_mode(argv: list[str]) -> list[str]:
    """``train`` / ``config validate`` on the engine's full mode (disaggregated, GAP + TSP + TAG + async),
    where the case leaves the config to the defaults: what these cases ran before the default run
    became colocated (the default's own engine cases: test_bad_input_on_the_default_colocated_run)."""
    n = 1 if argv[:1] == ["train"] else 2 if argv[:2] == ["config", "validate"] else 0
    if not n or "-c" in argv or "--resume" in argv:
        return argv
    return [*argv[:n], *FULL_MODE_SETS, *argv[n:]]


def run_case(argv, needle, tmp_path, monkeypatch, capsys, ray_address=None):
    t = make_inputs(tmp_path)
    if "big.txt" in " ".join(argv):
        write_big_prompt(t)
    argv = [a.replace("{t}", str(t)) for a in argv] + ["--run-dir", str(t / "run")] * (argv[0] == "train")
    if ray_address is not None:  # the suite's cluster (its warm workers), not a Ray started per case
        argv += ["--ray-address", ray_address]
    code, err = cli(monkeypatch, capsys, argv)
    assert code == 2, err
    assert needle.replace("{t}", str(t)) in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (t / "run").exists()  # nothing half-written
    assert not any((t / "adir").iterdir())


#: the cases refused only once the engine runs (inside run_engine), so on the path the placement decides
IN_THE_ENGINE = ["LoRA targets matching no module"]
#: cases that start Ray (~10 s each): the full suite runs them, the fast loop does not
STARTS_RAY = {*IN_THE_ENGINE, "a geneval prompt without GenEval metadata", "an ocr prompt quoting no text"}


@pytest.mark.parametrize("case", [c for c in CASES if c not in STARTS_RAY])
def test_bad_input_exits_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    argv, needle = CASES[case]
    run_case(full_mode(argv), needle, tmp_path, monkeypatch, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(STARTS_RAY))
def test_bad_input_on_the_engine_exits_2_with_one_line(case, ray_cluster, tmp_path, monkeypatch, capsys):
    """The cases refused once Ray runs, on the suite's cluster (``--ray-address``)."""
    argv, needle = CASES[case]
    run_case(full_mode(argv), needle, tmp_path, monkeypatch, capsys, ray_cluster)


@pytest.mark.slow
@pytest.mark.parametrize("case", IN_THE_ENGINE)
def test_bad_input_on_the_default_colocated_run(case, ray_cluster, tmp_path, monkeypatch, capsys):
    """The same one line from the default run: colocated workers, each a trainer that also rolls out."""
    argv, needle = CASES[case]
    run_case(argv, needle, tmp_path, monkeypatch, capsys, ray_cluster)


def tree_digest(root: Path) -> str:
    """One checksum over every file's path and bytes under ``root``."""
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def fake_run(root: Path) -> Path:
    (root / "checkpoints" / "iter-000002").mkdir(parents=True)
    (root / "config.yaml").write_text("train: {iterations: 2}\n")
    (root / "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    (root / "checkpoints" / "iter-000002" / "state.json").write_text("{}")
    return root


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            [],
            "--run-dir: {run} already holds a run; continue it with --resume {run}, choose a new --run-dir, "
            "or pass --overwrite to replace it",
        ),
    ],
)
def test_existing_run_directory_is_never_overwritten(tmp_path, monkeypatch, capsys, extra, needle):
    run = fake_run(tmp_path / "run")
    before = tree_digest(run)
    code, err = cli(monkeypatch, capsys, ["train", "--run-dir", str(run), *extra])
    assert code == 2 and err == f"error: {needle.format(run=run)}\n"
    assert tree_digest(run) == before


def test_overwrite_deletes_only_a_run(tmp_path, monkeypatch, capsys):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "holiday.jpg").write_bytes(b"\xff\xd8")
    before = tree_digest(other)
    code, err = cli(monkeypatch, capsys, ["train", "--run-dir", str(other), "--overwrite"])
    assert (
        code == 2
        and err.startswith(f"error: --overwrite: {other} is not a run directory")
        and err.count("\n") == 1
    )
    assert tree_digest(other) == before
    from digenrl.run.rundir import check_new_run_dir

    check_new_run_dir(fake_run(tmp_path / "run"), overwrite=True)  # a run may be replaced when asked


def test_help_text(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["digenrl", "plan", "--help"])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--json" in out and "--ladder" in out
    assert "<bool>" not in out and "╭" not in out


# ------------------------------------------------------------------ issue 25: nothing lost II


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished 1-iteration run directory of the tiny FLUX: RUN/config.yaml and one checkpoint."""
    from digenrl.checkpoint.store import save_checkpoint
    from digenrl.config.run import load_config
    from digenrl.policy.model import Policy

    run = tmp_path_factory.mktemp("tiny") / "run"
    sets = ["placement.mode=local", *TINY_IMAGE, "train.iterations=1"]
    cfg = load_config(None, [*sets, f"output.run_dir={run}"])
    run.mkdir()
    (run / "config.yaml").write_text(cfg.dump_yaml())
    save_checkpoint(run, Policy(cfg), 1, cfg, keep_last=1)
    return run


def copy_run(tiny_run: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


def edit_yaml(path: Path, **changes) -> None:
    """Set dotted keys (``train__lr=-1`` for train.lr) in a YAML file, as a user's editor would."""
    import yaml

    data = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        node = data
        for p in parents:
            node = node[p]
        node[last] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_resume_refuses_an_edited_run_config_and_leaves_it(tiny_run, tmp_path, monkeypatch, capsys):
    run = copy_run(tiny_run, tmp_path)
    edit_yaml(run / "config.yaml", train__lr=-1, train__iterations=3, model__lora__rank=3)
    edited = (run / "config.yaml").read_bytes()
    before = tree_digest(run)
    code, err = cli(monkeypatch, capsys, ["train", "--resume", str(run)])
    ckpt = run / "checkpoints" / "iter-000001" / "config.yaml"
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"error: --resume: {run / 'config.yaml'} differs from the config of the checkpoint it resumes "
        f"({ckpt}) in model.lora.rank, train.iterations, train.lr; "
    )
    assert f"digenrl train --resume {run} --set train.iterations=3 --set train.lr=-1" in err
    assert "train.lr: the optimizer continues at the new rate" in err
    assert "model.lora.rank cannot change on resume" in err
    assert (run / "config.yaml").read_bytes() == edited and tree_digest(run) == before  # never overwritten


def test_resume_with_set_of_the_edited_key_goes_on(tiny_run, tmp_path, monkeypatch, capsys):
    """The edit applied as the message says (--set): not refused (here: nothing left to do)."""
    run = copy_run(tiny_run, tmp_path)
    edit_yaml(run / "config.yaml", output__keep_last=2)
    code, out, err = cli_out(
        monkeypatch, capsys, ["train", "--resume", str(run), "--set", "output.keep_last=2"]
    )
    assert code == 0, err
    assert "nothing to do: the run already completed 1 of 1 iterations" in out
    assert not (run / ".lock").exists()


def cli_out(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.mark.parametrize("command", ["train --resume", "eval --checkpoint"])
def test_an_invalid_value_in_a_checkpoint_config_names_the_file(
    tiny_run, tmp_path, monkeypatch, capsys, command
):
    run = copy_run(tiny_run, tmp_path)
    ckpt_cfg = run / "checkpoints" / "iter-000001" / "config.yaml"
    text = ckpt_cfg.read_text()  # the same size: state.json's size check passes, the value is bad
    ckpt_cfg.write_text(re.sub(r"(?m)^  lr: .*$", lambda m: "  lr: -1".ljust(len(m.group(0))), text))
    assert ckpt_cfg.read_text() != text and len(ckpt_cfg.read_text()) == len(text)
    code, err = cli(monkeypatch, capsys, [*command.split(), str(run / "checkpoints" / "iter-000001")])
    assert code == 2 and err.startswith(f"error: {ckpt_cfg}: train.lr: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--baseline", "{t}/nope"], "error: --baseline: {t}/nope not found"),
        (["--prompts", "{t}/adir"], "error: --prompts: {t}/adir is a directory, not a file"),
        (["--prompts", "{t}/latin1.txt"], "error: --prompts: {t}/latin1.txt is not UTF-8 text"),
        (["--prompts", "{t}/big.txt"], "error: --prompts: {t}/big.txt:2: a prompt of 10799999 characters"),
    ],
)
def test_eval_errors_name_the_option(tiny_run, tmp_path, monkeypatch, capsys, extra, needle):
    t = make_inputs(tmp_path)
    write_big_prompt(t)
    argv = ["eval", "--checkpoint", str(tiny_run), *[a.replace("{t}", str(t)) for a in extra]]
    code, err = cli(monkeypatch, capsys, argv)
    assert code == 2 and err.startswith(needle.replace("{t}", str(t))) and err.count("\n") == 1, err
    assert not (tiny_run / "eval").exists()


def test_one_claim_per_run_directory(tmp_path, capsys):
    """RUN/.lock: a second claim (train or --resume) is refused naming the live owner; the directory a
    claim created goes when nothing was written into it."""
    import socket

    from digenrl.errors import UserError
    from digenrl.run.lock import claim_run_dir

    run = tmp_path / "runs" / "run"
    with claim_run_dir(run):
        for what in ("--run-dir", "--resume"):
            with pytest.raises(UserError) as exc:
                claim_run_dir(run, what)
            assert str(exc.value).startswith(
                f"{what}: {run} is in use by another digenrl train "
                f"(pid {os.getpid()} on {socket.gethostname()} since "
            )
    assert not run.parent.exists()  # created by the claim (runs/ too), nothing written: removed again
    assert capsys.readouterr().err == ""


def test_a_stale_lock_of_a_killed_run_is_taken_over(tmp_path, capsys):
    """A process that took the lock and was killed (SIGKILL: no clean-up ran) leaves RUN/.lock naming
    it; the next claim finds the lock free, says so, and holds it."""
    import subprocess

    from digenrl.run.lock import claim_run_dir

    run = tmp_path / "run"
    code = (
        "import os, signal, sys; from digenrl.run.lock import claim_run_dir; "
        "claim_run_dir(sys.argv[1]); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    dead = (run / ".lock").read_text().split()[1]
    with claim_run_dir(run):
        err = capsys.readouterr().err
        assert err.startswith(f"note: {run} was locked by a run that is no longer running (pid {dead} on ")
        assert err.endswith("taking it over\n") and err.count("\n") == 1
        assert (run / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    assert run.is_dir() and not (run / ".lock").exists()  # the directory existed before this claim


def file_digests(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def test_a_killed_overwrite_gets_the_old_run_back(tmp_path):
    """--overwrite set the old run aside, then the new run was killed before its first checkpoint:
    the next claim of the directory moves the old run back; once the new run has a checkpoint, the
    old one is deleted instead."""
    from digenrl.run.lock import ReplacedRun, claim_run_dir

    run = fake_run(tmp_path / "run")
    before = file_digests(run)
    ReplacedRun(run).set_aside()
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')  # the killed new run's partial files
    (run / "tensorboard").mkdir()
    claim_run_dir(run).unlock()
    assert file_digests(run) == before and not (run / ".replaced").exists()

    replaced = ReplacedRun(run)
    replaced.set_aside()
    assert not replaced.commit_if_safe()  # no checkpoint of the new run yet: the old run stays aside
    (run / "checkpoints" / "iter-000001").mkdir(parents=True)
    (run / "checkpoints" / "iter-000001" / "state.json").write_text("{}")
    assert replaced.commit_if_safe() and not replaced.finish()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]


@pytest.mark.slow
def test_overwrite_that_fails_at_the_first_iteration_keeps_the_old_run(tmp_path, monkeypatch, capsys):
    """--overwrite onto a finished run, with a reward server that answers the dry run and then NaN:
    the new run fails in iteration 0 (exit 2, one line) and every old file is back, byte for byte."""
    import importlib.util
    import math

    spec = importlib.util.spec_from_file_location(
        "reward_server", Path(__file__).parents[1] / "benchmarks" / "reward_server.py"
    )
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    calls = {"n": 0}

    def scores(images, prompts, metadata):
        calls["n"] += 1
        return [0.5 if calls["n"] == 1 else math.nan for _ in prompts]  # the dry run, then NaN

    httpd = server.make_server(scores, "127.0.0.1", 0)
    server.serve_in_thread(httpd)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    run = fake_run(tmp_path / "run")
    before = file_digests(run)
    sets = [*TINY, "output.save_samples_every=0", "placement.mode=local", "train.iterations=2"]
    sets.append(f"reward.components=[{{name: remote, args: {{url: '{url}', retries: 1, backoff: 0.01}}}}]")
    try:
        code, err = cli(
            monkeypatch,
            capsys,
            ["train", "--run-dir", str(run), "--overwrite", *as_sets(sets)],
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "reward 'remote' returned NaN" in err and calls["n"] >= 2
    assert err.rstrip().endswith(
        f"the old run in {run} was kept (--overwrite replaces it only once the new run has a checkpoint)"
    )
    assert file_digests(run) == before  # every old file, byte for byte
    assert sorted(p.name for p in run.iterdir()) == sorted(("checkpoints", "config.yaml", "metrics.jsonl"))


@pytest.mark.slow
def test_two_trainings_into_one_directory_one_refuses(tmp_path):
    """Two real `digenrl train` started 0.5 s apart into one --run-dir: exactly one runs, the other
    exits 2 with one line naming the directory and the live owner; the directory holds one run. The
    lock is taken before the driver is chosen, so the local trainer stands for the engine here (the
    engine only widens the window: Ray and the workers start after the lock)."""
    import subprocess
    import time

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "digenrl.cli.app", "train", "-q", "--run-dir", str(run)]
    argv += as_sets([*TINY, "output.save_samples_every=0", "train.iterations=2", "placement.mode=local"])
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    procs = []
    for _ in range(2):
        tmp = ray_tmpdir("di")  # each its own Ray cluster's files
        procs.append(
            subprocess.Popen(
                argv,
                env={**env, "RAY_TMPDIR": tmp},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        time.sleep(0.5)
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 2], results
    ((winner, winner_out),) = [(p, out) for p, out, _ in results if p.returncode == 0]
    (loser_err,) = [err for p, _, err in results if p.returncode == 2]
    assert loser_err.count("\n") == 1 and "Traceback" not in loser_err
    assert loser_err.startswith(
        f"error: --run-dir: {run} is in use by another digenrl train (pid {winner.pid} on "
    )
    assert f"run directory: {run}" in winner_out and "reward (mean of first third" in winner_out  # -q
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]  # one run: each iteration once
    assert len(list((run / "tensorboard").iterdir())) == 1
    assert not (run / ".lock").exists()
