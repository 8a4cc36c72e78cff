"""No host sync in the hot loop (issue 53, item 8): nothing in a forward -- a family's velocity, the
sampler's step with the KL reference at rollout, a train unit's terms up to their backward() -- reads
a device tensor on the host (``.item()``, ``bool()``, ``.cpu()``, ``nonzero``...), which on a GPU
waits for its queue to drain. tests/host_reads.py marks what stands for device tensors on a CPU.
On 8f4fead: Wan2.2's ``bool(high.all())`` per forward, Qwen-Image's ``mask.all()``, the rollout
reference's ``rows.cpu()`` and the ratio stats' ``.item()`` before every backward()."""

from __future__ import annotations

import contextlib

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.adapters.guidance import backward_through_velocity
from digenrl.config.run import load_config
from tests.host_reads import counted, on_device
from tests.test_pipeline_timesteps import CONFIGS, FAMILIES

#: family -> (the file whose reads are known, why): the family's other reads must still be none, and the
#: known ones must still happen (once fixed, drop the line). Z-Image passes the transformer each caption's
#: valid tokens, ``e[m.bool()]`` (z_image.py forward_pass: a boolean index of the device mask per row; the
#: lengths would have to travel on the host with the Cond). diffusers' own
#: HunyuanVideo15Transformer3DModel.forward reads ``if torch.all(image_embeds == 0)`` (text-to-video) and
#: reorders the text tokens by boolean-mask indexing per row: not the adapter's to fix.
KNOWN_SYNCS = {
    "z_image": ("z_image.py:", "the caption mask's boolean index"),
    "hunyuan_video15": ("transformer_hunyuan_video15.py:", "diffusers' t2v test and token reorder"),
    "hunyuan_video15_i2v": ("transformer_hunyuan_video15.py:", "diffusers' t2v test and token reorder"),
}


def _unknown(family, reads: list) -> list:
    where = KNOWN_SYNCS[family][0] if family in KNOWN_SYNCS else None
    known = [r for r in reads if where and r.split(" at ")[-1].startswith(where)]
    assert bool(known) == (family in KNOWN_SYNCS), f"{family}: {KNOWN_SYNCS.get(family)} no longer read"
    return [r for r in reads if r not in known]


def _adapter(family, tmp_path, *sets):
    path, overrides, _ = FAMILIES[family]
    cfg = load_config(CONFIGS / path, [*overrides, "model.dtype=bfloat16", *sets])
    ad = build_adapter(cfg.model, cfg.sampling)
    images = None
    if ad.edits:
        from tests.test_edit_adapters import edit_images

        images = edit_images(tmp_path, cfg.model.height, cfg.model.width)
    cond = ad.cond_for(["a red apple", "a blue sky"], images)
    cond.batched.update(on_device(cond.batched))
    return ad, cond, on_device(ad.initial_noise(2, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_forward_reads_nothing_on_the_host(family, tmp_path):
    """Rows of two noise levels (Wan2.2 A14B: one each side of the boundary, and the sharded ranks'
    lockstep), and training's sequential-CFG backward."""
    ad, cond, x = _adapter(family, tmp_path, "sampling.cfg_batching=sequential")
    sigma = ad.sigma_input(torch.tensor([0.95, 0.5]))  # from the host, as the sampler and units pass it
    sigma = sigma if ad.host_sigma else on_device(sigma)
    for lockstep in (False, True):
        with counted() as reads, ad.lockstep(lockstep), torch.no_grad():
            v = ad.velocity(x, sigma, cond)
        assert _unknown(family, reads) == [], f"{family}: {reads}"
    with counted() as reads:
        backward_through_velocity(ad, x, sigma, cond, lambda v: (v.float().square().mean(), None))
    assert _unknown(family, reads) == [], f"{family}: {reads}"
    assert v.shape == x.shape


def test_the_sampler_with_the_rollout_reference_reads_nothing_on_the_host():
    """The KL reference at rollout picks the rows that train a step on the host (its forward batches'
    rows as the sampler was given them), not from their device copies."""
    from digenrl.algorithms.sde import sample
    from digenrl.units.klref import RolloutReference

    cfg = load_config(CONFIGS / "wan2.2_tiny.yaml", ["model.lora=null"])
    ad = build_adapter(cfg.model, cfg.sampling)
    cond = ad.encode_prompts(["a", "b", "c", "d"])
    cond.batched.update(on_device(cond.batched))
    x = on_device(ad.initial_noise(4, torch.Generator().manual_seed(0)))
    train_idx = torch.tensor([[0, 2], [1, 3], [0, 1], [2, 3]])
    ref = RolloutReference(contextlib.nullcontext, train_idx, "flow_grpo", 0.7, lockstep=[0, 1, 2, 3])
    batches = [[torch.tensor([0, 1]), torch.tensor([2, 3])]] * 4
    g, sigmas = torch.Generator().manual_seed(0), ad.sigmas(4)
    with counted() as reads:
        sample(
            ad, cond, x, sigmas, "flow_grpo", 0.7, lambda s: torch.randn(s, generator=g), None, batches, ref
        )
    assert reads == [] and ref.forwards > 0, reads


@pytest.mark.parametrize("algorithm", ["flow_grpo", "flow_dppo", "diffusion_nft", "awm", "online_dpo"])
def test_a_train_unit_reads_its_stats_once_after_its_last_backward(algorithm, monkeypatch):
    """A unit's loss and ratio stats stay on the device until it ends: one read, after every backward."""
    from digenrl.data.prompts import PromptSampler, load_prompts
    from digenrl.policy.model import Policy
    from digenrl.rewards import build_reward
    from digenrl.units.advantages import assign_advantages
    from digenrl.units.rollout import rollout_unit, scored
    from digenrl.units.train import train_unit
    from tests.helpers import TINY

    cfg = load_config(None, [*TINY, f"algorithm.name={algorithm}", "algorithm.kl_beta=0.01"])
    torch.manual_seed(0)
    policy, prompts = Policy(cfg), PromptSampler(load_prompts(cfg.prompts), 0).for_iteration(0, 2)
    unit = scored(rollout_unit(policy, prompts, [0, 1], 0, 0), build_reward(cfg.reward))
    assign_advantages([unit], cfg)
    backward = torch.Tensor.backward
    with counted() as reads:
        monkeypatch.setattr(
            torch.Tensor, "backward", lambda *a, **k: reads.append("backward") or backward(*a, **k)
        )
        stats = train_unit(policy, unit, len(unit) * unit.train_idx.shape[1])
    last = max(i for i, r in enumerate(reads) if r == "backward")
    before = [r for r in reads[:last] if r != "backward"]
    assert before == [], before
    assert stats["terms"] > 0 and all(isinstance(v, (int, float)) for v in stats.values())
