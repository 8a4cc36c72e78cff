"""Every shipped config (configs/ and configs/recipes/) passes `digenrl config validate --ray-address`
(the check a user runs before `train` joins a cluster) as published, but for the paths only the user
has: the checkpoint directory -- here one holding only the real ``config.json`` files of the published
model (the adapter's ``published`` shapes), which is all the preflight reads -- the prompt file, and a
model reward's weights (then the weight-free ``prompt_color`` reward in its place). Placement, FSDP /
sequence parallelism / TAG / TSP and the memory preflight run as the config sets them: no shipped
arrangement is refused (issue 22: the DanceGRPO and MixGRPO recipes were)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digenrl.adapters import adapter_class
from digenrl.config.run import load_config
from tests.helpers import cli, write_edit_set

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
ADDRESS = "127.0.0.1:6379"  # validate does not join it: train checks the cluster's devices


def config_only_checkpoint(model, root: Path) -> Path:
    """A diffusers checkpoint directory with only the published model's config files, no weights (of
    the size the config names: SD3.5 Medium or Large)."""
    adapter = model.adapter
    ref = adapter_class(adapter).published_model(model)
    for sub, config in (("transformer", ref.transformer), ("vae", ref.vae)):
        (root / sub).mkdir(parents=True)
        (root / sub / "config.json").write_text(json.dumps(dict(config)))
    (root / "model_index.json").write_text(json.dumps({"_class_name": adapter}))
    return root


def user_paths(path: Path, tmp: Path) -> list[str]:
    """The ``--set`` overrides for the paths only the config's user has."""
    cfg = load_config(path)
    sets = []
    if cfg.model.pretrained is not None:
        sets.append(f"model.pretrained={config_only_checkpoint(cfg.model, tmp / 'ckpt')}")
    if cfg.prompts.file is not None and not (ROOT / cfg.prompts.file).is_file():
        if adapter_class(cfg.model.adapter).edits:  # an edit set: input images of the output's size
            sets.append(f"prompts.file={write_edit_set(tmp / 'edits', cfg.model.height, cfg.model.width)}")
        else:
            (tmp / "prompts.txt").write_text("a red cube\na blue sphere\n")
            sets.append(f"prompts.file={tmp / 'prompts.txt'}")
    if any("path" in c.args for c in cfg.reward.components):  # a model reward's local weights
        sets.append("reward.components=[{name: prompt_color}]")
    return sets


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_config_validates_with_a_ray_address(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # relative prompt files are the repository's
    sets = [a for s in user_paths(path, tmp_path) for a in ("--set", s)]
    code, out, err = cli(
        monkeypatch, capsys, "config", "validate", "-c", str(path), "--ray-address", ADDRESS, *sets
    )
    assert code in (0, None), err
    assert "verdict: runs" in out
    assert "refuse" not in out + err
