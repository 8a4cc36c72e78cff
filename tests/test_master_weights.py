"""fp32 master weights: a full fine-tune step at lr 1e-5 on a bf16-compute model updates (almost)
every trained element; the bf16-parameter baseline loses most updates to rounding."""

from __future__ import annotations

import torch

from digenrl.distributed.precision import fp32_master, trained_dtypes
from tests.helpers import TINY_IMAGE


def _bf16_flux_adapter():
    from digenrl.adapters import build_adapter
    from digenrl.config.run import load_config

    cfg = load_config(None, ["model.dtype=bfloat16", "model.lora=null", *TINY_IMAGE])
    adapter = build_adapter(cfg.model, cfg.sampling, "cpu")
    adapter.transformer.to(torch.bfloat16).requires_grad_(True)  # as from_pretrained(torch_dtype=bf16) gives
    return adapter


def _changed_fraction_after_one_step(adapter) -> float:
    net = adapter.transformer
    params = [p for p in net.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    cond = adapter.encode_prompts(["a red cube", "a blue ball"])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2, *adapter.latent_shape()), generator=gen)
    v = adapter.velocity(x, torch.tensor([0.7, 0.3]), cond)  # autocast: bf16 compute
    (v * torch.randn(v.shape, generator=gen)).mean().backward()
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    opt.step()
    changed = sum((p.detach() != b).sum().item() for p, b in zip(params, before))
    return changed / sum(p.numel() for p in params)


def test_fp32_masters_keep_every_update():
    baseline = _bf16_flux_adapter()
    master = _bf16_flux_adapter()
    assert fp32_master(master.transformer) > 0
    assert trained_dtypes(master.transformer) == {torch.float32}
    assert trained_dtypes(baseline.transformer) == {torch.bfloat16}
    kept = _changed_fraction_after_one_step(master)
    lost = _changed_fraction_after_one_step(baseline)
    assert kept > 0.99, kept  # measured 100%
    assert lost < 0.2, lost  # bf16 parameters: most updates round away (measured 3.5%)


def test_policy_trains_fp32_masters_and_ships_to_a_bf16_copy(tiny_cfg):
    """The trainer's policy keeps fp32 masters; a rollout policy holding compute-dtype (bf16)
    weights loads them verified, and a changed byte is refused."""
    import pytest

    from digenrl.errors import WeightSyncError
    from digenrl.policy.lora import checksum
    from digenrl.policy.model import Policy

    cfg = tiny_cfg("model.lora=null", "model.dtype=bfloat16")
    trainer = Policy(cfg, device="cpu")
    assert trained_dtypes(trainer.adapter.transformer) == {torch.float32}
    rollout = Policy(cfg, device="cpu", trainable=False)
    rollout.adapter.transformer.to(torch.bfloat16)
    state = trainer.weights()
    rollout.load_weights(state, 1, expected_checksum=checksum(state))
    got = rollout.adapter.transformer.state_dict()
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in state.items())
    bad = dict(state)
    key = next(iter(bad))
    bad[key] = bad[key].clone()
    bad[key].view(-1)[0] += 1.0
    with pytest.raises(WeightSyncError):
        rollout.load_weights(bad, 2, expected_checksum=checksum(state))
