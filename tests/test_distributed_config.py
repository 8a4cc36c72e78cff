"""train.fsdp / train.activation_checkpointing: validation, resolution, and the refusal of a
sharding degree while sharded trainer ranks are not wired into the engine (docs/errors.md)."""

import pytest

from digenrl.config import load_config
from digenrl.distributed.settings import resolve_activation_checkpointing, resolve_fsdp
from digenrl.errors import UserError
from tests.test_bad_input import cli

CASES = {
    "fsdp degree 0": (["--set", "train.fsdp=0"], "train.fsdp: must be auto, off or a sharding degree >= 1, got 0"),
    "fsdp word": (["--set", "train.fsdp=many"], "train.fsdp: must be auto, off or a sharding degree >= 1"),
    "checkpointing word": (["--set", "train.activation_checkpointing=maybe"], "train.activation_checkpointing"),
    "fsdp not wired": (["--set", "train.fsdp=2", "--set", "model.height=16", "--set", "model.width=16"],
                       "train.fsdp: 2: sharded trainer ranks are not wired into the engine yet"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_distributed_settings_exit_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    sets, needle = CASES[case]
    code, err = cli(monkeypatch, capsys, ["train", *sets, "--run-dir", str(tmp_path / "run")])
    assert code == 2, err
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_settings_resolve():
    cfg = load_config(None, [])
    assert cfg.train.fsdp == "auto" and cfg.train.activation_checkpointing == "auto"
    assert resolve_fsdp(cfg.train, 4) == 1 and not resolve_activation_checkpointing(cfg.train)  # auto: off for now
    on = load_config(None, ["train.activation_checkpointing=on", "train.fsdp=off"])  # YAML reads these as booleans
    assert on.train.activation_checkpointing == "on" and on.train.fsdp == "off"
    assert resolve_activation_checkpointing(on.train)
    assert resolve_fsdp(load_config(None, ["train.fsdp=2"]).train, 4) == 2
    with pytest.raises(UserError, match="train.fsdp: 3 does not divide the 4 trainer ranks"):
        resolve_fsdp(load_config(None, ["train.fsdp=3"]).train, 4)
