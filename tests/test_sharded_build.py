"""A rank that the layout shards never holds the whole model on its device (issue 53, item 4): its
transformer stays in host memory and ``fsdp.parallelize`` casts, moves and shards one block at a time.

(a) The sharded model equals the model built whole, bit for bit (2 gloo ranks, the tiny Wan2.2 A14B:
two experts and diffusers' fp32-kept modules; a random-init preset with full fine-tuning, and a saved
pretrained directory loaded in bf16, with LoRA). (b) The build's device bytes, counted by
``distributed.build_audit.DeviceBytes`` with the ``meta`` device standing in for the GPU (8 ranks of a
fake process group): the peak is this rank's shards plus one block (or the root's own tensors), far
below the whole transformer; on the old code the whole transformer reached the device at build time."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from tests.dist_spawn import spawn

WAN22 = "configs/wan2.2_tiny.yaml"


def _layout(cfg, world: int):
    from digenrl.placement.layout import RunLayout
    from digenrl.policy.settings import single_process_settings

    layout = mock.create_autospec(RunLayout, instance=True)
    layout.settings = dataclasses.replace(single_process_settings(cfg), fsdp=world)
    layout.will_shard.side_effect = lambda role: role != "rollout"
    return layout


def _equal_build(rank, world, out, sets):
    from digenrl.config.run import load_config
    from digenrl.distributed.fsdp import full_tensors
    from digenrl.engine.fsdp_group import shard_trainer_rank
    from digenrl.policy.model import Policy

    cfg = load_config(WAN22, sets)
    torch.manual_seed(0)  # (LoRA's init draws from the global generator)
    whole = Policy(cfg, device="cpu", trainable=False).adapter.transformer.state_dict()
    torch.manual_seed(0)
    policy = Policy(cfg, device="cpu", layout=_layout(cfg, world))
    host = policy.adapter.host_transformer
    shard_trainer_rank(policy, world)
    sharded = dict(full_tensors(policy.adapter.transformer))
    differ = [k for k, v in sharded.items() if not torch.equal(v, whole[k].to(v.dtype))]
    torch.save({"host": host, "keys": (set(whole), set(sharded)), "differ": differ}, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def wan22_dir(tmp_path_factory):
    """The tiny Wan2.2 A14B saved as a diffusers pipeline directory (both experts)."""
    from digenrl.adapters import build_adapter
    from digenrl.config.run import load_config
    from tests.test_wan22_adapter import pipeline_for

    cfg = load_config(WAN22, ["model.lora=null"])
    path = tmp_path_factory.mktemp("wan22") / "ckpt"
    pipeline_for(build_adapter(cfg.model, cfg.sampling)).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("source", ["preset, full fine-tuning", "pretrained bf16, LoRA"])
def test_the_sharded_build_equals_the_whole_build(source, wan22_dir, tmp_path):
    sets = ["model.lora=null", "algorithm.kl_beta=0.1"]
    if source.startswith("pretrained"):
        sets = [f"model.pretrained={wan22_dir}", "model.preset=null", "model.dtype=bfloat16"]
    spawn(_equal_build, 2, tmp_path, sets)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["host"] is True  # built in host memory, for parallelize to move
        assert r["keys"][0] <= r["keys"][1]  # every weight of the whole build (LoRA adds its own)
        assert r["differ"] == []


def _audit_build(rank, world, out, config, sets):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from digenrl.config.run import load_config
    from digenrl.distributed import fsdp
    from digenrl.distributed.blocks import transformer_blocks
    from digenrl.distributed.build_audit import DeviceBytes
    from digenrl.policy.model import Policy

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    cfg = load_config(config, ["model.height=16", "model.width=16", *sets])
    with DeviceBytes("meta") as audit:  # every storage the build puts on the rank's device ("meta")
        policy = Policy(cfg, device="meta", layout=_layout(cfg, 8))
        net = policy.adapter.transformer

        def full(m):  # what a unit holds whole on the device before sharding: trained weights in fp32
            own = sum(p.numel() * (4 if p.requires_grad else p.element_size()) for p in m.parameters())
            return own + sum(b.numel() * b.element_size() for b in m.buffers())

        units = [full(b) for b in transformer_blocks(net)]
        whole = full(net)
        fsdp.shard_policy(policy, fsdp.trainer_mesh(8, "cpu"), independent_replicas=True)
    audit._forget_freed()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in [*net.parameters(), *net.buffers()]]
    shards = sum(t.untyped_storage().nbytes() for t in local)
    result = {"peak": audit.peak, "end": audit.live, "shards": shards, "whole": whole}
    result["unit"] = max(*units, whole - sum(units))  # the largest block, or the root's own tensors
    result["devices"] = {t.device.type for t in local}
    torch.save(result, out / "audit.pt")


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, sets",
    [("configs/flux_tiny.yaml", ["model.lora=null"]), (WAN22, [])],
    ids=["flux full fine-tuning", "wan2.2 A14B LoRA"],
)
def test_no_rank_holds_the_whole_model_while_it_builds(config, sets, tmp_path):
    spawn(_audit_build, 0, tmp_path, config, sets, nprocs=1)
    r = torch.load(tmp_path / "audit.pt")
    assert r["devices"] == {"meta"}  # everything ended on the rank's device
    other = r["end"] - r["shards"]  # the VAE and the rest of what the rank keeps there
    assert 0 <= other and r["shards"] < r["whole"] / 4  # 1/8 each, with what FSDP leaves whole
    # the peak: what the rank ends with, plus one unit whole on its way to be sharded (hand count)
    assert r["peak"] <= r["end"] + r["unit"]
    assert r["peak"] - other < r["whole"]  # on the old code: other + the whole transformer at least


@pytest.mark.parametrize(
    "sets", [[], ["model.lora=null"], ["model.lora=null", "model.train_experts=low_noise"]]
)
def test_names_and_checksum_of_the_weights_read_without_a_copy(sets):
    """A worker reads the names a sync carries and the weights' checksum (``ready``) without copying
    the host-held model: the same as read off ``weights()``."""
    from digenrl.config.run import load_config
    from digenrl.policy.lora import checksum
    from digenrl.policy.model import Policy

    policy = Policy(load_config(WAN22, sets), device="cpu", trainable=False)
    weights = policy.weights()
    assert policy.weight_names() == set(weights) and len(weights) > 0
    assert policy.weights_checksum() == checksum(weights)
