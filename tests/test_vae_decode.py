"""Batched VAE decode in slices, and tiled for video (adapters/vae_decode.py), against decoding each sample
alone and untiled, through the adapters' own ``vae_decode`` on the tiny presets' real diffusers VAEs
(AutoencoderKLWan, AutoencoderKLHunyuanVideo) with small tiles so that tiling happens.

What is exact and what is within a tolerance (pixels in [0, 1]):

- slicing: a batch decodes one sample at a time and equals decoding each sample alone (1e-6);
- the adapters' tiled decode of a batch equals the VAE's own tiled decode of each sample alone (1e-6):
  slicing and tiling compose, with the configured tiles;
- tiled vs untiled: the VAE's tiles see less context than the whole sample, and their seams are blended,
  so the decode changes. Wan's spatial tiles on its random-init tiny VAE: mean |difference| 0.027 at 8-px
  overlaps, ~0.01 at 16 px (measured; asserted below 0.03 and falling with the overlap), single pixels up
  to 0.35 at the seams. HunyuanVideo's tiles differ far more on a random-init VAE (spatial: mean
  0.07-0.13, its GroupNorm statistics are taken per tile; time: single pixels up to 0.75) and are only
  checked to tile and to compose with slicing exactly. A trained VAE's statistics vary little from tile
  to tile, which is why diffusers offers tiling for it; these random-weight figures say nothing about
  the real seams -- check them on your own videos (docs/scaling.md, "Memory model").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.adapters.vae_decode import TILE_PX, configure_vae, tiling_mode
from digenrl.config.run import load_config

ROOT = Path(__file__).resolve().parents[1]
EXACT_ATOL = 1e-6
WAN_TILED_MEAN_ATOL = 0.03


def spatial(tile: int, stride: int, **more) -> dict:
    return dict(
        tile_sample_min_height=tile,
        tile_sample_min_width=tile,
        tile_sample_stride_height=stride,
        tile_sample_stride_width=stride,
        **more,
    )


CASES = {
    # 64x64 px x 9 frames: Wan latents 3 x 16 x 16 (x4 in space); tiles of 32 px every 24 (8-px overlap)
    "wan": (
        ROOT / "configs" / "wan_tiny.yaml",
        ["model.height=64", "model.width=64", "model.frames=9"],
        spatial(32, 24),
    ),
    # 64x64 px x 9 frames: Hunyuan latents 3 x 8 x 8 (x8 in space, x4 in time); tiles of 32 px every 24, and
    # of 8 frames every 4 in time
    "hunyuan_video": (
        ROOT / "configs" / "hunyuan_tiny.yaml",
        ["model.height=64", "model.width=64", "model.frames=9"],
        spatial(32, 24, tile_sample_min_num_frames=8, tile_sample_stride_num_frames=4),
    ),
}


def setup(family):
    path, overrides, tile = CASES[family]
    cfg = load_config(path, overrides)
    ad = build_adapter(cfg.model, cfg.sampling)
    z = torch.randn((2, *ad.latent_shape()), generator=torch.Generator().manual_seed(0))
    if family == "wan":  # the tiny VAE's latent channels (the transformer's are the same 4)
        assert z.shape[1] == ad.vae.config.z_dim
    return ad, z, tile


def per_sample_untiled(ad, z):
    configure_vae(ad.vae, "off")
    return torch.cat([ad.vae_decode(z[i : i + 1]) for i in range(len(z))])


@pytest.mark.parametrize("family", CASES)
def test_sliced_decode_equals_per_sample_decode(family):
    ad, z, _ = setup(family)
    ref = per_sample_untiled(ad, z)
    configure_vae(ad.vae, "off")
    calls = []
    inner = ad.vae._decode
    ad.vae._decode = lambda x, *a, **k: calls.append(x.shape[0]) or inner(x, *a, **k)
    batched = ad.vae_decode(z)
    assert calls == [1, 1]  # one sample at a time
    assert batched.shape == ref.shape == (2, 3, ad.cfg.frames, ad.cfg.height, ad.cfg.width)
    assert torch.allclose(batched, ref, atol=EXACT_ATOL, rtol=0), (batched - ref).abs().max()


def spy(vae, name: str) -> list:
    """Record the batch sizes ``vae.<name>`` is called with."""
    calls, inner = [], getattr(vae, name)
    setattr(vae, name, lambda x, *a, **k: calls.append(x.shape[0]) or inner(x, *a, **k))
    return calls


@pytest.mark.parametrize("family", CASES)
def test_tiled_batch_decode_is_each_samples_own_tiled_decode(family):
    ad, z, tile = setup(family)
    configure_vae(ad.vae, "on", tile)
    calls = spy(ad.vae, "tiled_decode")
    out = ad.vae_decode(z)
    assert calls and set(calls) == {1}  # tiled, one sample at a time
    alone = torch.cat([ad.vae_decode(z[i : i + 1]) for i in range(len(z))])
    assert torch.allclose(out, alone, atol=EXACT_ATOL, rtol=0)
    assert (
        out.shape == (2, 3, ad.cfg.frames, ad.cfg.height, ad.cfg.width) and 0 <= out.min() and out.max() <= 1
    )


def test_wan_tiled_decode_is_close_to_untiled_and_closer_with_more_overlap():
    ad, z, tile = setup("wan")
    ref = per_sample_untiled(ad, z)
    errors = []
    for t in (tile, spatial(48, 32)):  # overlaps of 8 and 16 px
        configure_vae(ad.vae, "on", t)
        calls = spy(ad.vae, "tiled_decode")
        diff = (ad.vae_decode(z) - ref).abs()
        assert calls, "the decode did not tile"
        errors.append(diff.mean().item())
        del ad.vae.tiled_decode  # the spy (an instance attribute) off again
    assert errors[0] <= WAN_TILED_MEAN_ATOL and errors[1] < errors[0], errors
    assert ref.std() > 3 * errors[0]  # not vacuous: the pixels vary far more than tiling moves them


def test_hunyuan_tiles_in_time_when_on_and_not_when_off():
    ad, z, tile = setup("hunyuan_video")
    configure_vae(ad.vae, "on", tile)
    calls = spy(ad.vae, "_temporal_tiled_decode")
    ad.vae_decode(z)
    assert calls == [1, 1]  # 3 latent frames > 2 per time tile: tiled in time, one sample at a time
    configure_vae(ad.vae, "off")
    ad.vae_decode(z)
    assert calls == [1, 1]  # off: whole samples (diffusers' default frame-wise decode switched off too)


def test_auto_tiles_above_the_memory_models_tile():
    small = load_config(ROOT / "configs" / "wan_tiny.yaml", [])
    assert tiling_mode(small.model, small.sampling) == "default"
    wan = load_config(ROOT / "configs" / "wan2.1_t2v_14b.yaml", [])  # 480 x 832 x 81 = 32 Mpx per video
    assert wan.model.height * wan.model.width * wan.model.frames > TILE_PX
    assert tiling_mode(wan.model, wan.sampling) == "on"
    off = load_config(ROOT / "configs" / "wan2.1_t2v_14b.yaml", ["sampling.vae_tiling=off"])
    assert tiling_mode(off.model, off.sampling) == "off"
