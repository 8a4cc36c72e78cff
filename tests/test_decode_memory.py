"""Decode memory (issue 53, item 6), measured with tests/live_bytes.py (what torch allocates, from
allocation to free): the VAE's [-1, 1] output becomes [0, 1] fp32 with one fp32 copy at most (on
8f4fead ``(image.float() / 2 + 0.5).clamp(0, 1)`` held two at once: ~0.39 GB per Wan 480p x 81-frame
sample each), and a rollout decodes its unit one sample at a time into a host buffer, so what the
decode holds beyond its result does not grow with the unit (it held every sample's pixels on the
device, then copied them)."""

from __future__ import annotations

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.adapters.pixels import decode_to_host
from digenrl.config.run import load_config
from tests.live_bytes import LiveBytes
from tests.test_pipeline_timesteps import CONFIGS, FAMILIES

IMAGE_FAMILIES = ["flux", "sd3", "qwen_image", "wan", "hunyuan_video"]  # each its own vae_decode


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_the_vae_output_is_scaled_with_one_fp32_copy(family, monkeypatch):
    path, sets, _ = FAMILIES[family]
    cfg = load_config(CONFIGS / path, [*sets, "model.lora=null"])
    ad = build_adapter(cfg.model, cfg.sampling)
    x = ad.to_spatial(ad.initial_noise(2, torch.Generator().manual_seed(0)))
    raw, decode = [], ad.vae.decode  # the VAE's own output, as the family's vae_decode calls it
    monkeypatch.setattr(ad.vae, "decode", lambda *a, **k: raw.append(decode(*a, **k)[0]) or (raw[-1],))
    with torch.no_grad():
        ad.vae_decode(x)
    real = raw[0]
    for dtype, copies in ((torch.bfloat16, 1), (torch.float32, 0)):  # a bf16 VAE's output; an fp32 one
        image = real.to(dtype)
        monkeypatch.setattr(ad.vae, "decode", lambda *a, image=image, **k: (image.clone(),))
        with torch.no_grad():
            want = (image.float() / 2 + 0.5).clamp(0, 1)
            with LiveBytes() as m:
                got = ad.vae_decode(x)
        assert torch.equal(got.reshape(want.shape), want)
        fp32 = image.numel() * 4
        held = m.peak - image.numel() * image.element_size()  # beyond the VAE's own output (its clone)
        assert held < (copies + 0.5) * fp32, (
            f"{family} {dtype}: {held} bytes beyond the output, {fp32} per copy"
        )


def test_a_unit_decodes_one_sample_at_a_time_into_host_memory():
    path, sets, _ = FAMILIES["wan"]
    cfg = load_config(CONFIGS / path, [*sets, "model.lora=null", "model.frames=5"])
    ad = build_adapter(cfg.model, cfg.sampling)
    held, batched = {}, {}
    for n in (2, 4, 8):
        x = ad.initial_noise(n, torch.Generator().manual_seed(n))
        with LiveBytes() as m:
            pixels = decode_to_host(ad, x)
        with LiveBytes() as whole:  # 8f4fead's: the unit at once, then to the host
            assert torch.equal(pixels, ad.decode(x).cpu()) and pixels.device.type == "cpu"
        size = pixels.numel() * pixels.element_size()
        held[n], batched[n] = m.peak - size, whole.peak - size
    assert 0 < held[8] == held[4] == held[2], held  # one sample's decode, whatever the unit
    assert batched[8] > batched[4] > batched[2] > held[2], batched  # the whole unit's, growing with it


def test_a_rollout_decodes_through_the_host_buffer(monkeypatch):
    from digenrl.data.prompts import PromptSampler, load_prompts
    from digenrl.policy.model import Policy
    from digenrl.units import rollout
    from tests.helpers import TINY

    cfg = load_config(None, [*TINY, "algorithm.group_size=2", "sampling.steps=2"])
    policy = Policy(cfg, device="cpu", trainable=False)
    calls = []
    monkeypatch.setattr(
        rollout, "decode_to_host", lambda ad, x: calls.append(len(x)) or decode_to_host(ad, x)
    )
    prompts = PromptSampler(load_prompts(cfg.prompts), 0).for_iteration(0, 1)
    _, decoded = rollout.rollout_unit(policy, prompts, [0], 0, 0)
    assert calls == [2] and len(decoded.pixels) == 2


def test_shared_prefix_sampling_writes_into_one_trajectory():
    """A branched rollout (prefix 1, a split at step 3) holds, beyond its trajectory, what one forward
    holds, however long the trajectory: its segments are sampled into the one buffer (on 8f4fead each
    segment's own buffers were copied to the leaves with repeat_interleave, then concatenated: the
    trajectory held twice, growing with the steps)."""
    from digenrl.policy.model import Policy
    from digenrl.units.branch import branched_sample, node_rng
    from tests.helpers import TINY

    cfg = load_config(None, [*TINY, "placement.mode=local"])
    torch.manual_seed(0)
    ad = Policy(cfg, trainable=False).adapter
    cond = ad.cond_for(["a red cube", "a blue ball"]).repeat_interleave(4)
    start = torch.randn(2, *ad.latent_shape(), generator=torch.Generator().manual_seed(3))
    held = {}
    for n in (16, 32):
        sigmas, mask = ad.sigmas(n), torch.arange(n) >= 1
        rng, nodes = torch.Generator().manual_seed(5), node_rng(0, 0, [0, 1])
        with torch.no_grad(), LiveBytes() as m:
            t = branched_sample(
                ad, cond, start, 4, sigmas, "flow_grpo", 1.0, rng, mask, None, 1, [(3, 2)], nodes
            )
        held[n] = m.peak - sum(x.numel() * x.element_size() for x in (t.latents, t.log_probs, t.noise))
        assert (
            (t.latents[0, :4] - t.latents[1, :4]).abs().max()
            == 0
            < (t.latents[0, 5] - t.latents[1, 5]).abs().max()
        )
    assert 0 < held[32] == held[16], held
