"""LoRA: every target must match, every load is verified, the KL reference is the LoRA-free model."""

import pytest
import torch

from digenrl.errors import UserError, WeightSyncError
from digenrl.policy.lora import checksum, load_lora_state_dict, lora_state_dict
from digenrl.policy.model import Policy


def test_target_matching_nothing_is_an_error(tiny_cfg):
    cfg = tiny_cfg("model.lora.targets=[to_q, to_qq]")
    with pytest.raises(UserError, match=r"model.lora.targets: \['to_qq'\] match no linear module"):
        Policy(cfg)


def test_weight_load_is_verified(tiny_cfg):
    p = Policy(tiny_cfg(), trainable=False)
    state = lora_state_dict(p.adapter.transformer)
    load_lora_state_dict(p.adapter.transformer, state, checksum(state))  # round trip is fine
    renamed = {k.replace("to_q", "to_qx"): v for k, v in state.items()}
    with pytest.raises(WeightSyncError, match="unexpected"):
        load_lora_state_dict(p.adapter.transformer, renamed)
    fewer = dict(list(state.items())[:-2])
    with pytest.raises(WeightSyncError, match="missing"):
        load_lora_state_dict(p.adapter.transformer, fewer)
    with pytest.raises(WeightSyncError, match="checksum"):
        load_lora_state_dict(p.adapter.transformer, state, "0" * 64)


def test_full_finetuning_ships_all_weights(tiny_cfg):
    p = Policy(tiny_cfg("model.lora=null"))
    assert not p.lora and len(p.params) == len(list(p.adapter.transformer.parameters()))
    w = p.weights()
    assert set(w) == set(p.adapter.transformer.state_dict())
    p.load_weights(w, version=3, expected_checksum=checksum(w))
    assert p.version == 3


def test_kl_is_zero_before_the_first_update_and_positive_after(tiny_cfg, tmp_path):
    from digenrl.engine.local import LocalTrainer

    cfg = tiny_cfg("train.iterations=2", "algorithm.kl_beta=0.04", f"output.run_dir={tmp_path}")
    rows = LocalTrainer(cfg).run().metrics
    assert rows[0]["kl"] == 0.0  # LoRA B starts at zero: policy == reference
    assert rows[1]["kl"] > 0.0


def test_reference_context_disables_lora(tiny_cfg):
    p = Policy(tiny_cfg(), trainable=False)
    for n, prm in p.adapter.transformer.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(prm)
    ad = p.adapter
    cond = ad.encode_prompts(["a red car"])
    x = ad.initial_noise(1, torch.Generator().manual_seed(0))
    sig = torch.tensor([0.5])
    with torch.no_grad():
        with_lora = ad.velocity(x, sig, cond)
        with p.reference():
            ref = ad.velocity(x, sig, cond)
        ad.transformer.disable_adapters()
        base = ad.velocity(x, sig, cond)
        ad.transformer.enable_adapters()
    assert torch.equal(ref, base) and not torch.allclose(ref, with_lora)
