"""Broadcast weight sync over a standalone gloo group (one source, two receivers), with the real
tiny FLUX + peft LoRA and full weights: keys and fingerprints equal after every version, a
corrupted bucket detected, the prefetch running while the receiver generates."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tests.dist_spawn import free_port, spawn
from tests.helpers import TINY_IMAGE

pytestmark = pytest.mark.slow

SMALL_BUCKETS = 16 * 1024  # several buckets even for the tiny model


def _policy(full: bool, trainable: bool):
    from digenrl.config.run import load_config
    from digenrl.policy.model import Policy

    sets = [*TINY_IMAGE] + (["model.lora=null"] if full else [])
    return Policy(load_config(None, sets), device="cpu", trainable=trainable)


def _train_a_little(policy, version: int) -> None:
    """Stand-in for an optimizer step: move every trained parameter (seeded by version)."""
    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in policy.params:
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


def _source(group, out):
    from digenrl.distributed.broadcast import WeightBroadcaster
    from digenrl.distributed.staged import sync_targets
    from digenrl.engine.faults import corrupting
    from digenrl.policy.lora import checksum, lora_state_dict

    sender = WeightBroadcaster(group, bucket_bytes=SMALL_BUCKETS)
    lora, full = _policy(False, True), _policy(True, True)
    record = {}
    for version in (1, 2):  # LoRA versions
        _train_a_little(lora, version)
        sender.publish(version, sync_targets(lora.adapter.transformer, lora=True))
        record[f"lora{version}"] = checksum(lora_state_dict(lora.adapter.transformer))
    _train_a_little(full, 3)  # full weights, fp32 masters shipped as bf16
    sender.publish(3, sync_targets(full.adapter.transformer, lora=False), send_dtype=torch.bfloat16)
    record["full3"] = checksum(
        {k: v.to(torch.bfloat16) for k, v in full.adapter.transformer.state_dict().items()}
    )
    # version 4: a bit flipped in the second bucket on its way (broadcast calls: size, header, buckets...)
    _train_a_little(lora, 4)
    with corrupting(group, bucket=1, element=5):
        sender.publish(4, sync_targets(lora.adapter.transformer, lora=True))
    group.store.wait(["generating"])  # version 5 only once a receiver is busy generating
    _train_a_little(lora, 5)
    sender.publish_async(5, sync_targets(lora.adapter.transformer, lora=True)).result()
    record["lora5"] = checksum(lora_state_dict(lora.adapter.transformer))
    _train_a_little(full, 6)  # 6: full weights received straight into the receiver's tensors
    sender.publish(6, sync_targets(full.adapter.transformer, lora=False), send_dtype=torch.bfloat16)
    record["full6"] = checksum(
        {k: v.to(torch.bfloat16) for k, v in full.adapter.transformer.state_dict().items()}
    )
    for version in (7, 8):  # 7: refused by the receiver; 8: still in step
        _train_a_little(lora, version)
        sender.publish(version, sync_targets(lora.adapter.transformer, lora=True))
    record["lora8"] = checksum(lora_state_dict(lora.adapter.transformer))
    out.write_text(json.dumps(record))


def _receiver(rank, group, out):
    from digenrl.distributed.broadcast import WeightReceiver
    from digenrl.distributed.staged import sync_targets
    from digenrl.errors import WeightSyncError
    from digenrl.policy.lora import checksum, lora_state_dict

    receiver = WeightReceiver(group)
    lora, full = _policy(False, False), _policy(True, False)
    full.adapter.transformer.to(torch.bfloat16)  # a rollout worker holds compute-dtype weights
    record = {}
    for version in (1, 2):
        got = receiver.receive()
        assert got.version == version and len(got.buckets) > 1
        receiver.load(got, sync_targets(lora.adapter.transformer, lora=True))
        record[f"lora{version}"] = checksum(lora_state_dict(lora.adapter.transformer))
    got = receiver.receive()
    targets = sync_targets(full.adapter.transformer, lora=False)
    receiver.load(got, targets)
    record["full3"] = checksum(dict(full.adapter.transformer.state_dict()))
    wrong = dict(targets)
    wrong.pop(next(iter(wrong)))
    with pytest.raises(WeightSyncError, match="1 unexpected keys"):
        receiver.load(got, wrong)
    got = receiver.receive()
    with pytest.raises(WeightSyncError, match=r"fingerprint mismatch after load .*\(bucket 1\)"):
        receiver.load(got, sync_targets(lora.adapter.transformer, lora=True))
    record["corrupted_detected"] = True
    # prefetch version 5 while "generating" (sampling forwards), load at the unit boundary. The
    # background receive is held after its first broadcast until the main thread has run a whole
    # forward since: the overlap is then shown whatever the machine's load (timing alone is not)
    receiver.prefetch()
    arrived, generated, real = threading.Event(), threading.Event(), group.broadcast

    def held(tensor, src):
        real(tensor, src)
        if not arrived.is_set():
            arrived.set()
            generated.wait(timeout=120)

    group.broadcast = held
    if rank == 1:
        group.store.set("generating", "1")
    cond = lora.adapter.encode_prompts(["a cat"])
    x = torch.randn(1, *lora.adapter.latent_shape())
    spans = []  # (start, end, the receive was in progress when the forward started)
    while not receiver.ready():
        during = arrived.is_set()
        start = time.time()
        with torch.no_grad():
            lora.adapter.velocity(x, torch.tensor([0.5]), cond)
        spans.append((start, time.time(), during))
        if during:
            generated.set()
    got = receiver.wait()
    group.broadcast = real
    receiver.load(got, sync_targets(lora.adapter.transformer, lora=True))
    record["lora5"] = checksum(lora_state_dict(lora.adapter.transformer))
    sync = got.event  # a forward ran inside the receive's own span
    record["overlap"] = any(during and sync["start"] <= s and e <= sync["end"] for s, e, during in spans)
    receiver.receive_into(sync_targets(full.adapter.transformer, lora=False))
    record["full6"] = checksum(dict(full.adapter.transformer.state_dict()))
    with pytest.raises(WeightSyncError, match="missing keys"):  # every bucket drained, then refused
        receiver.receive_into(sync_targets(full.adapter.transformer, lora=False))
    receiver.receive_into(sync_targets(lora.adapter.transformer, lora=True))
    record["lora8"] = checksum(lora_state_dict(lora.adapter.transformer))
    out.write_text(json.dumps(record))


def _member(rank, _world, port, tmp):
    from digenrl.distributed.broadcast import SyncGroup

    group = SyncGroup(rank, 3, "127.0.0.1", port, backend="gloo", timeout_s=120)
    out = tmp / f"rank{rank}.json"
    _source(group, out) if rank == 0 else _receiver(rank, group, out)


def test_broadcast_versions_fingerprints_corruption_and_prefetch(tmp_path):
    spawn(_member, 0, free_port(), tmp_path, nprocs=3)
    source = json.loads((tmp_path / "rank0.json").read_text())
    for rank in (1, 2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for key in (
            "lora1",
            "lora2",
            "full3",
            "lora5",
            "full6",
            "lora8",
        ):  # SHA-256 of the loaded weights, independently
            assert got[key] == source[key], (rank, key)
        assert source["lora1"] != source["lora2"]
        assert got["corrupted_detected"]
    # the receiver that signalled kept generating while version 5 arrived
    assert json.loads((tmp_path / "rank1.json").read_text())["overlap"]


def _fsdp_source_member(rank, _world, ports, tmp):
    """Processes 0 and 1: FSDP2 trainer ranks (their own default group); process 2: a rollout
    receiver. Process 0 is rank 0 of the sync group and streams the gathered full tensors."""
    import os

    import torch.distributed as dist

    from digenrl.distributed import fsdp
    from digenrl.distributed.broadcast import SyncGroup, WeightBroadcaster, WeightReceiver
    from digenrl.distributed.staged import specs_for, sync_targets
    from digenrl.policy.lora import checksum

    trainer_port, sync_port = ports
    if rank < 2:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(trainer_port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        policy = _policy(False, True)
        fsdp.shard_policy(policy, fsdp.trainer_mesh())
        with torch.no_grad():  # move this rank's shards (a stand-in for a sharded optimizer step)
            gen = torch.Generator().manual_seed(rank)
            for p in policy.params:
                local = p.to_local()
                local.add_(torch.randn(local.shape, generator=gen) * 1e-3)
        net = policy.adapter.transformer
        names = sync_targets(net, lora=True)
        stream = fsdp.full_tensors(net, list(names))
        if rank == 0:
            group = SyncGroup(0, 2, "127.0.0.1", sync_port, timeout_s=120)
            WeightBroadcaster(group, bucket_bytes=SMALL_BUCKETS).publish(1, stream, specs=specs_for(names))
        else:
            for _ in stream:  # take part in every gather, in the same order
                pass
        full = {n: t.clone() for n, t in fsdp.full_tensors(net, list(names))}
        if rank == 0:
            (tmp / "fsdp_source.json").write_text(json.dumps({"sha": checksum(full)}))
        dist.destroy_process_group()
    else:
        group = SyncGroup(1, 2, "127.0.0.1", sync_port, timeout_s=120)
        lora = _policy(False, False)
        targets = sync_targets(lora.adapter.transformer, lora=True)
        before = checksum(dict(targets))
        WeightReceiver(group).receive_into(targets)
        (tmp / "fsdp_receiver.json").write_text(
            json.dumps({"before": before, "sha": checksum(dict(targets))})
        )


def test_fsdp_trainer_ranks_stream_gathered_shards_to_a_receiver(tmp_path):
    spawn(_fsdp_source_member, 0, (free_port(), free_port()), tmp_path, nprocs=3)
    sent = json.loads((tmp_path / "fsdp_source.json").read_text())["sha"]
    got = json.loads((tmp_path / "fsdp_receiver.json").read_text())
    assert got["sha"] == sent and got["before"] != sent
