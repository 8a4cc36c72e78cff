"""Every shipped tiny config runs with nothing but itself, from any working directory (issue 56): its
relative paths (the edit sets beside the configs) are read from the config's folder. One iteration
each, in this process; those of tests/test_families.py and tests/test_families_2026.py run there (also
from another directory)."""

import math
import sys
from pathlib import Path

import pytest

from digenrl.config.run import load_config
from digenrl.run.rundir import read_metrics
from tests.test_families import FAMILIES
from tests.test_families_2026 import CONFIGS as FAMILIES_2026

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIGS = sorted((ROOT / "configs").glob("*tiny*.yaml"))
ELSEWHERE = {(ROOT / p).resolve() for p in FAMILIES.values()} | set(FAMILIES_2026.values())
#: what makes one iteration cheap without touching the config's files: fewer denoising steps
CHEAP = ["train.iterations=1", "sampling.steps=2", "sampling.eval_steps=2"]


def test_every_tiny_config_is_run_here_or_in_test_families():
    assert TINY_CONFIGS and ELSEWHERE <= set(TINY_CONFIGS)


def test_a_config_reads_its_relative_paths_from_its_own_folder(tmp_path, monkeypatch):
    """From another directory the edit configs find their shipped set; a --set path is read from the
    working directory; a missing one names the path it looked for and why there."""
    from digenrl.data.prompts import check_prompts
    from digenrl.errors import UserError

    monkeypatch.chdir(tmp_path)
    for name in ("flux_kontext_tiny", "qwen_image_edit_tiny"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.prompts.file.is_relative_to(ROOT / "configs" / "edits")
        assert len(check_prompts(cfg)) == 2
    # a --set path is read from the working directory, and held absolute: a run's saved config.yaml
    # (read from its checkpoint's folder by `digenrl eval --checkpoint`) finds it there too
    assert (
        load_config(ROOT / "configs" / "flux_kontext_tiny.yaml", ["prompts.file=p.jsonl"]).prompts.file
        == tmp_path / "p.jsonl"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.yaml").write_text("prompts:\n  file: mine/p.txt\n")
    cfg = load_config(Path("sub/c.yaml"))
    with pytest.raises(UserError) as exc:
        check_prompts(cfg)
    assert str(exc.value) == (
        f"prompts.file: {tmp_path}/sub/mine/p.txt not found (prompts.file: mine/p.txt in sub/c.yaml is read "
        "from that file's folder)"
    )


def test_a_set_path_survives_the_runs_saved_config(tmp_path, monkeypatch):
    """``--set prompts.file=configs/smallworld`` (relative, from the repo) -> the run's config.yaml ->
    read again from a checkpoint's folder (``digenrl eval --checkpoint``): the same prompt set. It was
    read against the checkpoint's folder, "not found" (benchmarks/learning.py --eval hit it)."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / "smallworld_flux.yaml", ["prompts.file=configs/smallworld"])
    saved = tmp_path / "checkpoints" / "iter-000002" / "config.yaml"
    saved.parent.mkdir(parents=True)
    saved.write_text(cfg.dump_yaml())
    monkeypatch.chdir(tmp_path)
    assert load_config(saved).prompts.file == ROOT / "configs" / "smallworld"


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in TINY_CONFIGS if c not in ELSEWHERE], ids=lambda p: p.stem)
def test_every_tiny_config_trains_from_another_directory(config, tmp_path, monkeypatch, ray_cluster):
    from digenrl.cli.app import main

    monkeypatch.chdir(tmp_path)
    ray = [] if load_config(config).placement.mode == "local" else ["--ray-address", ray_cluster]
    sets = [a for s in CHEAP for a in ("--set", s)]
    monkeypatch.setattr(
        sys, "argv", ["digenrl", "train", "-q", "-c", str(config), *sets, "--run-dir", "run", *ray]
    )
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 0
    (row,) = read_metrics(tmp_path / "run")
    assert row["version"] == 1 and math.isfinite(row["reward_mean"])
