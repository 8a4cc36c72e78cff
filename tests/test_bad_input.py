"""Every bad input a user can cause: one line on stderr naming the field or file, exit code 2,
no traceback, nothing written. The same list is the table in docs/errors.md."""

import sys

import pytest

from digenrl.cli.app import main


def cli(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr().err


def make_inputs(tmp):
    (tmp / "bad.yaml").write_text("train:\n  iterations: [1\n")
    (tmp / "empty.txt").write_text("\n\n")
    (tmp / "partial").mkdir()
    (tmp / "partial" / "config.yaml").write_text("")
    return tmp


SMALL = ["--set", "model.height=16", "--set", "model.width=16"]
CASES = {
    "malformed YAML": (["train", "-c", "{t}/bad.yaml"], "bad.yaml: malformed YAML at line"),
    "unknown key": (["train", "--set", "train.lr_max=1"], "train.lr_max: unknown key"),
    "negative size": (["train", "--set", "train.prompts_per_iteration=-4"], "train.prompts_per_iteration"),
    "zero size": (["train", "--set", "model.lora.rank=0"], "model.lora.rank"),
    "group size 1": (["train", "--set", "algorithm.group_size=1"], "algorithm.group_size"),
    "groups do not divide into units": (["train", "--set", "engine.unit_groups=3"], "engine.unit_groups"),
    "mini-batches that do not divide a group": (["train", "--set", "train.optimizer_steps=3"],
                                                "train.optimizer_steps (3) must divide algorithm.group_size"),
    "LoRA targets matching no module": (["train", *SMALL, "--set", "model.lora.targets=[to_qkv]"],
                                        "model.lora.targets: ['to_qkv'] match no linear module"),
    "missing checkpoint directory (model)": (["train", "--set", "model.pretrained={t}/nope"], "{t}/nope"),
    "missing checkpoint (resume)": (["train", "--resume", "{t}/no-run"], "no-run"),
    "run without a complete checkpoint": (["train", "--resume", "{t}/partial"], "partial"),
    "missing checkpoint (eval)": (["eval", "--checkpoint", "{t}/no-ckpt"], "no-ckpt"),
    "missing reward weights directory": (["train", *SMALL, "--set",
                                          "reward.components=[{name: clipscore, args: {path: {t}/no-clip}}]"],
                                         "no-clip"),
    "unknown reward": (["train", "--set", "reward.components=[{name: hpsv9}]"], "unknown reward 'hpsv9'"),
    "empty prompt file": (["train", "--set", "prompts.file={t}/empty.txt"], "empty.txt holds no prompts"),
    "missing prompt file": (["train", "--set", "prompts.file={t}/none.txt"], "none.txt not found"),
    "unknown adapter": (["train", "--set", "model.adapter=sd3"], "unknown adapter 'sd3'"),
    "resolution the model cannot take": (["train", "--set", "model.height=18"], "model.height"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    t = make_inputs(tmp_path)
    argv, needle = CASES[case]
    argv = [a.replace("{t}", str(t)) for a in argv] + ["--run-dir", str(t / "run")] * (argv[0] == "train")
    code, err = cli(monkeypatch, capsys, argv)
    assert code == 2, err
    assert needle.replace("{t}", str(t)) in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (t / "run").exists()  # nothing half-written
