"""A frozen Wan2.2 expert is never shipped (issue 53, item 5): with ``model.train_experts: low_noise``
and full fine-tuning, a version carries ``transformer_2``'s state alone -- half the bytes of both
experts (A14B: ~14.3 GB of bf16 instead of ~28.6 per publish) -- on both transports (the object store's
``Policy.weights``, the broadcast's ``sync_targets``, which FSDP ranks gather from), and a rollout copy
loads it. On 8f4fead every publish held both experts' state."""

from __future__ import annotations

from pathlib import Path

import torch

from digenrl.config.run import load_config
from digenrl.distributed.staged import sync_targets
from digenrl.engine.weight_sync import state_bytes
from digenrl.policy.lora import checksum
from digenrl.policy.model import Policy

WAN22 = Path(__file__).resolve().parents[1] / "configs" / "wan2.2_tiny.yaml"


def test_a_version_ships_the_trained_expert_alone():
    cfg = load_config(WAN22, ["model.lora=null", "model.train_experts=low_noise", "model.frames=1"])
    policy = Policy(cfg, device="cpu")
    net = policy.adapter.transformer
    shipped = policy.weights()
    low = net.transformer_2.state_dict()
    assert set(shipped) == {f"transformer_2.{k}" for k in low} == set(sync_targets(net, lora=False))
    both = state_bytes(net.state_dict())
    assert state_bytes(shipped) == state_bytes(low) == both // 2, (state_bytes(shipped), both)

    rollout = Policy(cfg, device="cpu", trainable=False)
    frozen = {k: v.clone() for k, v in rollout.adapter.transformer.transformer.state_dict().items()}
    with torch.no_grad():  # a step of the trained expert
        for p in net.transformer_2.parameters():
            p.add_(0.01)
    state = policy.weights()
    rollout.load_weights(state, 1, expected_checksum=checksum(state))
    got = rollout.adapter.transformer
    assert all(torch.equal(v, got.state_dict()[k]) for k, v in state.items())
    assert all(torch.equal(v, got.transformer.state_dict()[k]) for k, v in frozen.items())


def test_both_experts_trained_ship_both():
    cfg = load_config(WAN22, ["model.lora=null", "model.frames=1"])
    policy = Policy(cfg, device="cpu")
    assert set(policy.weights()) == set(policy.adapter.transformer.state_dict())
