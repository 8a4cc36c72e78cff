"""The device fingerprint: equal for equal bits, different for any one or two changed values,
independent of how many passes it takes (single process, fast)."""

import pytest
import torch

from digenrl.distributed import fingerprint as fp_module
from digenrl.distributed.fingerprint import fingerprint, fingerprints


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8])
def test_every_single_flipped_bit_position_changes_the_fingerprint(dtype):
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 129, generator=gen) * 50).to(dtype)
    ref = fingerprint(t)
    assert torch.equal(ref, fingerprint(t.clone()))
    raw = t.view(-1).view(torch.uint8)
    for byte in torch.randint(0, raw.numel(), (40,), generator=gen).tolist():
        for bit in (0, 3, 7):
            u = t.clone()
            u.view(-1).view(torch.uint8)[byte] ^= 1 << bit
            assert not torch.equal(ref, fingerprint(u)), (byte, bit)


def test_cancelling_pairs_and_swaps_are_detected():
    t = torch.randn(5000).to(torch.bfloat16)
    ref = fingerprint(t)
    for i, j in [(0, 1), (0, 1024), (7, 4999), (1023, 1024)]:
        u = t.clone()
        v = u.view(torch.int16)
        v[i] += 3
        v[j] -= 3  # the plain sum is unchanged
        assert not torch.equal(ref, fingerprint(u)), (i, j)
        w = t.clone()
        w[i], w[j] = t[j], t[i]  # a swap
        if not torch.equal(t[i], t[j]):
            assert not torch.equal(ref, fingerprint(w)), (i, j)


def test_passes_do_not_change_the_result(monkeypatch):
    t = torch.randn(70_001)
    one_pass = fingerprint(t)
    monkeypatch.setattr(fp_module, "_ROWS_PER_PASS", 3)
    assert torch.equal(one_pass, fingerprint(t))
    assert fingerprints([t, t[:5]]).shape == (2, 3)


def test_the_trainer_ranks_agreement_digest_sees_one_changed_lora_value():
    """What trainer ranks compare after each step (``Policy.agreement_digest``): equal on equal LoRA
    weights, different after one value of one LoRA tensor moves by one ulp, computed from the
    parameters where they live (no host copy of the weights: ``weights()`` is not called)."""
    from digenrl.config.run import load_config
    from digenrl.policy.model import Policy
    from tests.helpers import TINY

    cfg = load_config(None, [*TINY, "placement.mode=local"])
    a, b = Policy(cfg, device="cpu"), Policy(cfg, device="cpu")
    b.load_weights(a.weights(), 0)
    b.weights = a.weights = None  # the digest must not go through the host copy of the weights
    assert a.agreement_digest() == b.agreement_digest()
    name, p = next((n, p) for n, p in b.named_params.items() if "lora_B" in n)
    with torch.no_grad():
        flat = p.view(-1)
        flat[3] = torch.nextafter(flat[3], torch.tensor(float("inf"), dtype=flat.dtype))
    assert a.agreement_digest() != b.agreement_digest(), name
