"""The memory model against the real modules, the memory preflight (before Ray starts) and the
settings ``plan --write`` writes (docs/scaling.md, "Memory model")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from digenrl.cli.app import main
from digenrl.config.run import load_config
from digenrl.placement.preflight import check_memory, resolve_memory_settings
from digenrl.placement.resolve import resolve
from digenrl.planner.memory import MemoryModel
from digenrl.planner.params import CostParams
from digenrl.planner.workload import Workload
from tests.helpers import FULL_MODE

ROOT = Path(__file__).resolve().parents[1]
FLUX = str(ROOT / "configs" / "flux1_dev.yaml")
REAL = [
    "flux1_dev.yaml",
    "wan2.1_t2v_14b.yaml",
    "wan2.1_t2v_14b_240p.yaml",
    "hunyuan_video.yaml",
    "qwen_image.yaml",
]
FULL_FT_UNSHARDED = ["--set", "model.lora=null", "--set", "train.fsdp=off"]


def cli(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    return exc.value.code, capsys.readouterr()


def _model(cfg) -> MemoryModel:
    return MemoryModel(Workload.from_config(cfg), CostParams())


@pytest.mark.parametrize("lora", [True, False])
def test_memory_model_counts_the_real_modules_bytes(lora):
    """Weights, fp32 masters and AdamW state of the tiny FLUX equal a direct count of the built
    module's tensors (a Policy: fp32 masters, one real AdamW step)."""
    from digenrl.policy.model import Policy

    cfg = load_config(None, [] if lora else ["model.lora=null"])
    model = _model(cfg)
    policy = Policy(cfg, device="cpu", trainable=False)
    weights = sum(
        p.numel() * p.element_size()
        for n, p in policy.adapter.transformer.named_parameters()
        if "lora_" not in n
    )
    assert model.rollout_parts(1)["weights"] == weights
    policy = Policy(cfg, device="cpu")
    for p in policy.params:
        p.grad = torch.ones_like(p)
    policy.optimizer_step()
    masters = sum(p.numel() * p.element_size() for p in policy.params)
    state = sum(
        v.numel() * v.element_size()
        for s in policy.optimizer.state.values()
        for v in s.values()
        if v.dim() > 0
    )
    parts = model.train_parts(1, 1, False)
    assert all(p.dtype == torch.float32 for p in policy.params)
    assert parts["fp32 masters"] == masters == parts["fp32 grads"]
    assert parts["AdamW state"] == state
    halved = model.train_parts(2, 1, False)  # FSDP x2: every sharded part halves
    for key in ("fp32 masters", "fp32 grads", "AdamW state"):
        assert halved[key] == parts[key] / 2


def test_activations_with_checkpointing_keep_the_block_inputs():
    cfg = load_config(FLUX, [])
    m = _model(cfg)
    t, blocks = m.workload.shape.tokens, m.workload.params.blocks
    assert m.block_input_bytes() == (t.x + t.text) * m.workload.params.hidden * 2  # bf16
    assert m.train_acts(1, True) == pytest.approx(m.block_input_bytes() * blocks + m.act_bytes_per_block())
    assert m.train_acts(2, False) == 2 * m.train_acts(1, False)
    wan = _model(load_config(str(ROOT / "configs" / "wan2.1_t2v_14b.yaml"), []))
    assert (
        wan.workload.passes == 2
        and wan.train_acts(1, False) == 2 * wan.act_bytes_per_block() * wan.workload.params.blocks
    )


def test_preflight_refuses_unsharded_full_fine_tuning_before_ray(tmp_path, monkeypatch, capsys):
    def no_ray(*args):  # the suite's Ray cluster may be up: the refusal must come before joining it
        raise AssertionError("the run reached Ray")

    monkeypatch.setattr("digenrl.engine.cluster.connect", no_ray)
    run = tmp_path / "run"
    code, out = cli(monkeypatch, capsys, ["train", "-c", FLUX, *FULL_FT_UNSHARDED, "--run-dir", str(run)])
    assert code == 2, out.err
    assert out.err.count("\n") == 1 and "Traceback" not in out.err
    line = out.err.strip()
    assert line.startswith("error: train.fsdp: pool 'trainer' (8 x H800, 80 GB")
    assert "a trainer rank needs" in line and "set train.fsdp: 8" in line
    assert not run.exists()
    code, out = cli(monkeypatch, capsys, ["config", "validate", "-c", FLUX, *FULL_FT_UNSHARDED])
    assert code == 2 and out.err.strip() == line


def test_auto_resolves_to_the_first_fitting_setting():
    cfg = load_config(FLUX, ["model.lora=null"])
    s = resolve_memory_settings(cfg)
    assert (s.fsdp, s.activation_checkpointing, s.device) == (8, True, "H800")
    assert s.need_bytes <= s.have_bytes
    m = _model(cfg)
    for fsdp, ac in ((4, True), (8, False)):  # the cheaper settings do not fit
        need = sum(
            m.trainer_need(fsdp, cfg.train.micro_batch, ac, tag=True, groups=cfg.engine.unit_groups).values()
        )
        assert need > s.have_bytes
    check_memory(load_config(FLUX, ["model.lora=null", "train.fsdp=8", "train.activation_checkpointing=on"]))


@pytest.mark.parametrize("name", REAL)
def test_shipped_real_scale_configs_fit(name):
    cfg = load_config(str(ROOT / "configs" / name), [])
    check_memory(cfg)
    s = resolve_memory_settings(cfg)
    assert 0 < s.need_bytes <= s.have_bytes


def test_cpu_pools_are_not_checked():
    cfg = load_config(None, [*FULL_MODE, "model.lora=null", "train.fsdp=off"])
    assert {p.device for p in cfg.cluster.pools} == {"cpu"}
    check_memory(cfg)
    assert resolve_memory_settings(cfg).fsdp == 1


@pytest.mark.slow  # seconds of planner search or model timing: the full suite runs it
def test_plan_write_contains_the_settings_it_assumes(tmp_path, monkeypatch, capsys):
    import json

    from digenrl.placement.layout import RunLayout
    from digenrl.placement.resolve import resolve

    # 16 GPUs: the best plan shards (colocated or beside TAG: plans the engine runs)
    src, cluster, out = tmp_path / "flux_full.yaml", tmp_path / "16xH800.yaml", tmp_path / "plan.yaml"
    src.write_text(load_config(FLUX, ["model.lora=null"]).dump_yaml())
    cluster.write_text("name: 16xH800\ngpus_per_node: 8\npools:\n  - {name: h800, device: H800, count: 16}\n")
    monkeypatch.setattr(
        sys,
        "argv",
        ["digenrl", "plan", "-c", str(src), "--cluster", str(cluster), "--top", "1", "--write", str(out)],
    )
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code in (0, None), capsys.readouterr().err
    text = out.read_text()
    comments = [line for line in text.splitlines() if line.lstrip().startswith("#")]
    assert "assumes" not in text and not any(
        "offload" in line for line in comments
    )  # no claim the runtime lacks
    assert yaml.safe_load(text)["model"]["offload_text_encoders"] is False  # the one offload there is: off
    train = yaml.safe_load(text)["train"]
    assert train["fsdp"] > 1 and train["activation_checkpointing"] in ("on", "off")  # full FT: sharded
    cfg = load_config(out)
    check_memory(cfg)  # what it wrote passes the preflight as written
    layout = resolve(cfg)  # ... and is a sharding the engine runs
    written = json.loads(out.with_suffix(".layout.json").read_text())
    assert RunLayout.from_dict(written) == layout  # plan --write writes exactly the layout train resolves
    # the sharded KL reference (issue 36) lets FSDP x4 fit where x8 was needed
    n = train["fsdp"]
    assert layout.settings.fsdp == n and len(layout.shard_groups) == len(layout.trainer_ranks) // n
    s = resolve_memory_settings(cfg)
    assert (s.fsdp, s.activation_checkpointing, s.micro_batch) == (
        train["fsdp"],
        train["activation_checkpointing"] == "on",
        train["micro_batch"],
    )


def test_a_rollout_pool_that_cannot_hold_a_unit_names_a_smaller_one(monkeypatch, capsys):
    pools = [
        "--set",
        "cluster.pools=[{name: rollout, device: L40S, count: 8}, {name: trainer, device: H800, count: 8}]",
    ]
    code, out = cli(
        monkeypatch,
        capsys,
        # the trainer's batches: a forward may hold the whole unit (auto would shrink the batch instead)
        [
            "config",
            "validate",
            "-c",
            FLUX,
            *pools,
            "--set",
            "engine.unit_groups=8",
            "--set",
            "engine.rollout_batch=trainer",
        ],
    )
    assert code == 2 and out.err.count("\n") == 1
    assert out.err.startswith("error: engine.unit_groups: pool 'rollout' (8 x L40S, 48 GB")
    assert (
        "set engine.unit_groups: 4 (fewer samples per unit)" in out.err
    )  # 4 divides the 32 prompts; 5, 6 do not
    # the suggested unit fits (the memory check alone: this host has none of the cluster's GPUs)
    check_memory(load_config(Path(FLUX), [pools[1], "engine.unit_groups=4"]))
    # auto: the unit of 8 groups fits at the rollout batch the memory model picks for an L40S
    cfg = load_config(Path(FLUX), [pools[1], "engine.unit_groups=8"])
    b = resolve(cfg).settings.rollout_batch
    assert 1 <= b < 8 * cfg.algorithm.group_size  # not the whole unit of 64 samples
    model = MemoryModel(Workload.from_config(cfg), CostParams())
    assert model.rollout("L40S", 8, batch=b).fits and not model.rollout("L40S", 8, batch=b + 1).fits


def test_the_error_names_the_key_to_change():
    from digenrl.errors import UserError

    wan = str(ROOT / "configs" / "wan2.1_t2v_14b_240p.yaml")  # on the placement it shipped with before
    shipped = [
        "cluster.pools=[{name: rollout, device: H20, count: 16}, {name: trainer, device: H800, count: 8}]",
        "placement.mode=disaggregated",
        "placement.rollout_pool=rollout",
        "placement.trainer_pool=trainer",
        "engine.rollout_sp=1",
        "engine.trainer_sp=1",
        "engine.unit_groups=2",
        "train.micro_batch=2",
    ]
    with pytest.raises(
        UserError
    ) as exc:  # both CFG passes' activations at once, 40 blocks: needs checkpointing
        check_memory(load_config(wan, [*shipped, "train.activation_checkpointing=off"]))
    assert str(exc.value).startswith("train.activation_checkpointing: pool 'trainer' (8 x H800")
    assert str(exc.value).endswith("GiB)") and "set train.activation_checkpointing: on (needs" in str(
        exc.value
    )
    small = (
        "cluster.pools=[{name: rollout, device: H800, count: 8}, {name: trainer, device: RTX4090, count: 2}]"
    )
    with pytest.raises(UserError, match=r"^cluster.pools.trainer: .* no setting fits 2 trainer ranks"):
        check_memory(load_config(FLUX, ["model.lora=null", small]))
