"""train.fsdp / train.activation_checkpointing: validation, resolution, and the refusal of a
sharding degree in the combinations the engine does not wire (docs/errors.md)."""

import pytest

from digenrl.config import load_config
from digenrl.distributed.settings import resolve_activation_checkpointing, resolve_fsdp
from digenrl.errors import UserError
from tests.test_bad_input import cli

TINY = ["--set", "model.height=16", "--set", "model.width=16"]
TSP1 = ["--set", "engine.tsp_degree=1"]
TWO_TRAINERS = ["--set", "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]"]

CASES = {
    "fsdp degree 0": (["--set", "train.fsdp=0"], "train.fsdp: must be auto, off or a sharding degree >= 1, got 0"),
    "fsdp word": (["--set", "train.fsdp=many"], "train.fsdp: must be auto, off or a sharding degree >= 1"),
    "checkpointing word": (["--set", "train.activation_checkpointing=maybe"], "train.activation_checkpointing"),
    # what train.fsdp N is not wired for (settings.check_fsdp_wired), each refused before Ray starts
    "fsdp not the trainer count": (["--set", "train.fsdp=2", *TINY],
                                   "train.fsdp: 2: must equal the number of trainer ranks (1); HSDP"),
    "fsdp local": (["--set", "train.fsdp=2", "--set", "placement.mode=local", *TINY],
                   "train.fsdp: 2: sharded trainer ranks need placement.mode: disaggregated (got local)"),
    "fsdp with tag": (["--set", "train.fsdp=2", *TWO_TRAINERS, *TINY],
                      "train.fsdp: 2: not with engine.tag (every FSDP rank must run the same forward / backward"),
    "fsdp random timesteps": (["--set", "train.fsdp=2", *TWO_TRAINERS, "--set", "engine.tag=false", *TSP1,
                               "--set", "algorithm.timesteps.mode=random", *TINY],
                              "train.fsdp: 2: not with algorithm.timesteps.mode: random"),
    "fsdp with tsp": (["--set", "train.fsdp=2", *TWO_TRAINERS, "--set", "engine.tag=false",
                       "--set", "engine.tsp_degree=2", *TINY], "train.fsdp: 2: not with engine.tsp_degree > 1"),
    "fsdp with eval": (["--set", "train.fsdp=2", *TWO_TRAINERS, "--set", "engine.tag=false", *TSP1,
                        "--set", "output.eval_every=1", *TINY], "train.fsdp: 2: not with output.eval_every"),
    "fsdp uneven unit": (["--set", "train.fsdp=2", *TWO_TRAINERS, "--set", "engine.tag=false", *TSP1,
                          "--set", "algorithm.group_size=3", *TINY],
                         "train.fsdp: 2: engine.unit_groups x algorithm.group_size (1 x 3): 3 samples per unit must "
                         "split evenly over the 2 ranks"),
    # sequence parallelism: config keys exist, the engine does not run them yet (settings.check_sp_wired)
    "rollout sp": (["--set", "engine.rollout_sp=2", *TINY,  # 2 rollout devices: one worker of sp 2
                    "--set", "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]"],
                   "engine.rollout_sp: 2: sequence parallelism is not wired into the engine yet"),
    "trainer sp": (["--set", "engine.trainer_sp=2", "--set", "placement.mode=local", *TINY],
                   "engine.trainer_sp: 2: sequence parallelism is not wired into the engine yet"),
    "sp not dividing its pool": (["--set", "engine.rollout_sp=2", *TINY],
                                 "engine.rollout_sp: 2 does not divide pool 'rollout' (1 x cpu): a worker spans 2"),
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
    assert resolve_fsdp(cfg, 4) == 1 and not resolve_activation_checkpointing(cfg)  # auto on CPU pools: off
    on = load_config(None, ["train.activation_checkpointing=on", "train.fsdp=off"])  # YAML reads these as booleans
    assert on.train.activation_checkpointing == "on" and on.train.fsdp == "off"
    assert resolve_activation_checkpointing(on)
    assert resolve_fsdp(load_config(None, ["train.fsdp=2"]), 4) == 2
    with pytest.raises(UserError, match="train.fsdp: 3 does not divide the 4 trainer ranks"):
        resolve_fsdp(load_config(None, ["train.fsdp=3"]), 4)


def test_resuming_sharded_trainer_ranks_is_refused(tmp_path):
    """The checkpoint of a sharded run holds the full state; only an unsharded run resumes it."""
    from digenrl.engine.runtime import run_engine
    from digenrl.trainer import LocalTrainer

    small = ["model.height=16", "model.width=16", "train.iterations=1", "train.prompts_per_iteration=2",
             "algorithm.group_size=2", "sampling.steps=2"]
    LocalTrainer(load_config(None, small + ["placement.mode=local"])).run(tmp_path / "run")
    cfg = load_config(None, small + ["train.iterations=2", "train.fsdp=2", "engine.tag=false", "engine.tsp_degree=1",
                                     "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]"])
    with pytest.raises(UserError, match="train.fsdp: 2: resuming sharded trainer ranks is not wired yet; resume "
                                        "with train.fsdp: off"):
        run_engine(cfg, resume=tmp_path / "run")
