"""train.fsdp / train.activation_checkpointing: validation, resolution, and the refusal of a
sharding degree in the combinations the engine does not wire (docs/errors.md)."""

import pytest

from digenrl.config.run import load_config
from digenrl.errors import UserError
from digenrl.placement.resolve import resolve
from tests.helpers import FULL_MODE, FULL_MODE_SETS, TINY_IMAGE, as_sets
from tests.test_bad_input import cli

TSP1 = ["--set", "engine.tsp_degree=1"]
TWO_TRAINERS = ["--set", "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]"]

CASES = {
    "fsdp degree 0": (
        ["--set", "train.fsdp=0"],
        "train.fsdp: must be auto, off or a sharding degree >= 1, got 0",
    ),
    "fsdp word": (["--set", "train.fsdp=many"], "train.fsdp: must be auto, off or a sharding degree >= 1"),
    "checkpointing word": (
        ["--set", "train.activation_checkpointing=maybe"],
        "train.activation_checkpointing",
    ),
    # what train.fsdp N means nothing with (resolve.fsdp_degree), each refused before Ray starts
    "fsdp not the trainer count": (
        ["--set", "train.fsdp=2", *as_sets(TINY_IMAGE)],
        "train.fsdp: 2: must divide the number of trainer ranks (1); use train.fsdp: 1 or off",
    ),
    "fsdp local": (
        ["--set", "train.fsdp=2", "--set", "placement.mode=local", *as_sets(TINY_IMAGE)],
        "train.fsdp: 2: sharded trainer ranks need placement.mode: disaggregated or colocated (got local)",
    ),
    # issue 53, item 7: a plain FSDP group wider than a node (STRICT_PACK) can never be placed
    "fsdp wider than a node": (
        [
            "--set",
            "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 16}]",
            "--set",
            "cluster.gpus_per_node=8",
            "--set",
            "train.fsdp=16",
            *as_sets(TINY_IMAGE),
        ],
        "train.fsdp: 16: a shard group must fit one node of 8 GPUs (a plain FSDP group of 16 spans nodes "
        "and can never be placed); use train.fsdp: 8 (HSDP: 2 replica groups of 8)",
    ),
    # sequence parallelism: what engine.rollout_sp and trainer_sp mean nothing with (resolve.check_sp)
    "rollout sp local": (
        ["--set", "engine.rollout_sp=2", "--set", "placement.mode=local", *as_sets(TINY_IMAGE)],
        "engine.rollout_sp: 2: sequence-parallel workers need placement.mode: disaggregated or colocated "
        "(got local)",
    ),
    "rollout sp uneven devices": (
        ["--set", "engine.rollout_sp=2", "--set", "engine.tag=false", *as_sets(TINY_IMAGE)],
        "engine.rollout_sp: 2: must divide the 1 rollout devices",
    ),
    "rollout sp heads": (
        [
            "--set",
            "engine.rollout_sp=3",
            "--set",
            "engine.tag=false",
            *as_sets(TINY_IMAGE),
            "--set",
            "cluster.pools=[{name: rollout, count: 3}, {name: trainer, count: 1}]",
        ],
        "engine.rollout_sp: 3: the model's 2 attention heads do not split over 3 devices",
    ),
    "trainer sp local": (
        ["--set", "engine.trainer_sp=2", "--set", "placement.mode=local", *as_sets(TINY_IMAGE)],
        "engine.trainer_sp: 2: sequence-parallel workers need placement.mode: disaggregated",
    ),
    "trainer sp uneven devices": (
        ["--set", "engine.trainer_sp=2", "--set", "engine.tag=false", *as_sets(TINY_IMAGE)],
        "engine.trainer_sp: 2: must divide the 1 trainer devices",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_distributed_settings_exit_2_with_one_line(case, tmp_path, monkeypatch, capsys):
    sets, needle = CASES[case]
    # on the engine's full mode (disaggregated, TSP 2, TAG): the settings these cases refuse are its
    argv = ["train", *FULL_MODE_SETS, *sets, "--run-dir", str(tmp_path / "run")]
    code, err = cli(monkeypatch, capsys, argv)
    assert code == 2, err
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_config_validate_refuses_a_shard_group_wider_than_a_node(tmp_path, monkeypatch, capsys):
    """`config validate` says what `train` would (the same line, exit 2); nodes of 16 take the group,
    and so does HSDP's split of it on nodes of 8."""
    wide = ["cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 16}]", *TINY_IMAGE, *FULL_MODE]
    argv = ["config", "validate", *as_sets([*wide, "train.fsdp=16", "cluster.gpus_per_node=8"])]
    code, err = cli(monkeypatch, capsys, argv)
    assert code == 2 and "HSDP: 2 replica groups of 8" in err and err.count("\n") == 1, err
    assert (
        resolve(load_config(None, [*wide, "train.fsdp=16", "cluster.gpus_per_node=16"])).settings.fsdp == 16
    )
    hsdp = resolve(load_config(None, [*wide, "train.fsdp=8", "cluster.gpus_per_node=8"]))
    assert len(hsdp.shard_groups) == 2


def test_settings_resolve():
    """The run's layout resolves train.fsdp / train.activation_checkpointing once (auto on CPU pools:
    off), with the shard groups (HSDP: several) that follow from the degree."""
    four = "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 4}]"
    cfg = load_config(None, [*FULL_MODE, four])
    assert cfg.train.fsdp == "auto" and cfg.train.activation_checkpointing == "auto"
    layout = resolve(cfg)
    assert layout.settings.fsdp == 1 and not layout.settings.activation_checkpointing
    assert layout.shard_groups == () and layout.hidden == set()
    on = load_config(
        None, [*FULL_MODE, "train.activation_checkpointing=on", "train.fsdp=off"]
    )  # YAML reads these as booleans
    assert on.train.activation_checkpointing == "on" and on.train.fsdp == "off"
    assert resolve(on).settings.activation_checkpointing
    two = resolve(
        load_config(None, [*FULL_MODE, four, "train.fsdp=2", "engine.tag=false", "engine.tsp_degree=1"])
    )
    assert two.settings.fsdp == 2
    assert two.shard_groups == (("trainer0", "trainer1"), ("trainer2", "trainer3"))
    assert two.leads == {"trainer1": "trainer0", "trainer3": "trainer2"}
    assert [w.name for w in two.scheduled] == ["rollout0", "trainer0", "trainer2"]
    with pytest.raises(UserError, match=r"train.fsdp: 3: must divide the number of trainer ranks \(4\)"):
        resolve(load_config(None, [*FULL_MODE, four, "train.fsdp=3"]))


def test_the_planner_never_proposes_a_sharding_the_engine_refuses():
    """FLUX.1-dev full fine-tuning on 16 H800 needs FSDP: the engine runs every sharding the search
    ranks (beside TAG, colocated), and every plan it ranks is one `train` runs. On 8 H800
    only a colocated FSDP x8 placement fits, so the planner says nothing fits rather than propose it."""
    from pathlib import Path

    from digenrl.cli.plan import plan_config
    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.gpus import cluster_from_dict
    from digenrl.planner.search import search
    from digenrl.planner.workload import Workload

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "flux1_dev.yaml", ["model.lora=null"])

    def h800s(n):
        return cluster_from_dict(
            {
                "name": f"{n}xH800",
                "gpus_per_node": 8,
                "pools": [{"name": "h800", "device": "H800", "count": n}],
            }
        )

    for n in (8, 16):  # 8 H800 fit colocated FSDP x8 (DanceGRPO's arrangement), now a plan it runs
        cluster = h800s(n)
        res = search(CostModel(Workload.from_config(cfg), cluster), cluster, top=3)
        refused = [why for why, _ in res.rejected.values() if "which the engine refuses" in why]
        # only uneven shares, and (issue 53) shard groups wider than a node, with HSDP's split named
        wide = [why for why in refused if "fit one node of 8 GPUs" in why]
        assert all("split evenly" in why or "divide" in why for why in set(refused) - set(wide))
        assert all("HSDP" in why or "train.fsdp: off" in why for why in wide) and (n == 8 or wide)
        assert res.ranked
        for r in res.ranked:
            trainer = r.setups[r.plan.trainer_pools[0].name]
            assert r.plan.ranks % trainer.shard == 0 and trainer.shard <= 8
            out = plan_config(cfg, r, cluster)
            assert out.cluster.gpus_per_node == 8
            resolve(out)  # raises on a refused sharding


def test_sp_inside_fsdp_is_accepted_with_units_that_split_over_the_groups():
    """train.fsdp: 4 with engine.trainer_sp: 2 (checked as functions: this host's CLI refuses 5 logical
    CPU devices): accepted, and each unit must split over the 2 sequence-parallel groups."""
    sets = [
        *FULL_MODE,
        *TINY_IMAGE,
        "engine.tag=false",
        "engine.tsp_degree=1",
        "train.fsdp=4",
        "engine.trainer_sp=2",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 4}]",
    ]
    layout = resolve(load_config(None, sets + ["algorithm.group_size=2"]))  # 2 samples: one per group
    assert layout.shard_groups == (("trainer0", "trainer1", "trainer2", "trainer3"),)
    assert layout.trainer_sp_groups == (("trainer0", "trainer1"), ("trainer2", "trainer3"))
    assert layout.followers_of("trainer0") == ("trainer1", "trainer2", "trainer3")  # FSDP leads SP too
    assert layout.followers_of("trainer2") == ()

    resolve(load_config(None, sets + ["algorithm.group_size=3"]))  # 2 + 1: uneven shares run


def test_a_shard_group_must_hold_whole_sequence_parallel_groups():
    """The one sharding refusal beside trainer SP (docs/distributed.md, "What is refused, and why"):
    shard groups of 3 over SP pairs would split a pair's sample between two groups."""
    sets = [
        *FULL_MODE,
        *TINY_IMAGE,
        "engine.trainer_sp=2",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 6}]",
    ]
    with pytest.raises(UserError, match=r"train.fsdp: 3: must be a multiple of engine.trainer_sp \(2\)"):
        resolve(load_config(None, sets + ["train.fsdp=3"]))
    assert len(resolve(load_config(None, sets + ["train.fsdp=2"])).shard_groups) == 3  # HSDP of SP pairs
