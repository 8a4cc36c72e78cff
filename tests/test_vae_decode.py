"""Batched VAE decode in slices, and tiled for video (adapters/vae_decode.py), against decoding each sample
alone and untiled, through the adapters' own ``vae_decode`` on the tiny presets' real diffusers VAEs
(AutoencoderKLWan, AutoencoderKLHunyuanVideo) with small tiles so that tiling happens.

Tolerances (pixels in [0, 1]): slicing is exact up to kernel rounding (1e-6); tiles blend at their seams,
so the tiled decode differs from the untiled one there -- by at most TILED_ATOL on these VAEs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.adapters.vae_decode import TILE_PX, configure_vae, tiling_mode
from digenrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SLICED_ATOL = 1e-6
TILED_ATOL = 0.05
TILED_MEAN_ATOL = 0.01
CASES = {
    # 64x64 px x 9 frames: Wan latents 16x16 (x4), tiles of 32 px every 24 (latent 8 / 6)
    "wan": (ROOT / "configs" / "wan_tiny.yaml", ["model.height=64", "model.width=64", "model.frames=9"],
            dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                 tile_sample_stride_width=24)),
    # 64x64 px x 13 frames: Hunyuan latents 4 x 8 x 8 (x8, x4 in time); tiles of 32 px every 24, and of
    # 8 frames every 4 in time
    "hunyuan_video": (ROOT / "configs" / "hunyuan_tiny.yaml", ["model.height=64", "model.width=64", "model.frames=13"],
                      dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                           tile_sample_stride_width=24, tile_sample_min_num_frames=8,
                           tile_sample_stride_num_frames=4)),
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
    assert torch.allclose(batched, ref, atol=SLICED_ATOL, rtol=0), (batched - ref).abs().max()


@pytest.mark.parametrize("family", CASES)
def test_tiled_decode_equals_untiled_within_tolerance(family):
    ad, z, tile = setup(family)
    ref = per_sample_untiled(ad, z)
    configure_vae(ad.vae, "on", tile)
    tiled_calls = []
    inner = ad.vae.tiled_decode
    ad.vae.tiled_decode = lambda x, *a, **k: tiled_calls.append(tuple(x.shape)) or inner(x, *a, **k)
    out = ad.vae_decode(z)
    assert tiled_calls, "the decode did not tile"
    assert out.shape == ref.shape
    diff = (out - ref).abs()
    assert diff.max() <= TILED_ATOL and diff.mean() <= TILED_MEAN_ATOL, (diff.max(), diff.mean())
    assert ref.std() > 10 * diff.mean()  # not vacuous: the pixels vary far more than the seams move them


def test_auto_tiles_above_the_memory_models_tile():
    small = load_config(ROOT / "configs" / "wan_tiny.yaml", [])
    assert tiling_mode(small.model, small.sampling) == "default"
    wan = load_config(ROOT / "configs" / "wan2.1_t2v_14b.yaml", [])  # 480 x 832 x 81 = 32 Mpx per video
    assert wan.model.height * wan.model.width * wan.model.frames > TILE_PX
    assert tiling_mode(wan.model, wan.sampling) == "on"
    off = load_config(ROOT / "configs" / "wan2.1_t2v_14b.yaml", ["sampling.vae_tiling=off"])
    assert tiling_mode(off.model, off.sampling) == "off"
