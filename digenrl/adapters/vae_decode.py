"""How an adapter's VAE decodes a batch (``sampling.vae_tiling``): one sample at a time, tiled where
configured or where a sample is larger than the decode tile (:data:`TILE_PX`).

Details: docs/modules.md, `digenrl.adapters.vae_decode`.
"""

from __future__ import annotations

import torch

#: pixels (height x width x frames) of one sample above which ``auto`` tiles, and the most a tiled
#: decode holds at once: the planner's memory model reads its decode tile from here
#: (``CostParams.vae_tile_px``), so the runtime decodes what the model sized
TILE_PX = 4.0e6


def tiling_mode(model, sampling) -> str:
    """``on`` | ``off`` | ``default`` (the VAE's own: no spatial tiles; HunyuanVideo's time tiles): what
    ``sampling.vae_tiling`` asks for; ``auto`` is ``on`` above the tile, else ``default``."""
    if sampling.vae_tiling == "auto":
        return "on" if model.height * model.width * (model.frames or 1) > TILE_PX else "default"
    return sampling.vae_tiling


def configure_vae(vae, mode: str, tile: dict | None = None) -> None:
    """Slice the batch; ``mode`` (:func:`tiling_mode`) ``on``: tile, with the VAE's default tile sizes
    or ``tile``'s ``enable_tiling`` arguments; ``off``: whole samples, no tiles in space or time."""
    if hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
    if mode == "on" and hasattr(vae, "enable_tiling"):
        vae.enable_tiling(**(tile or {}))
        if hasattr(vae, "use_framewise_decoding"):  # HunyuanVideo: tiles in time too
            vae.use_framewise_decoding = True
    elif mode == "off":
        if hasattr(vae, "disable_tiling"):
            vae.disable_tiling()
        if hasattr(vae, "use_framewise_decoding"):  # HunyuanVideo decodes in time tiles by default
            vae.use_framewise_decoding = False


def unit_range(image: torch.Tensor) -> torch.Tensor:
    """A VAE's [-1, 1] output in [0, 1], fp32, as the pipelines' postprocess: one fp32 copy at most
    (none of an fp32 output, which is changed in place), not one per operation."""
    return image.float().div_(2).add_(0.5).clamp_(0, 1)


@torch.no_grad()
def decode_to_host(adapter, latents: torch.Tensor) -> torch.Tensor:
    """``adapter.decode`` of a unit's latents one sample at a time, each copied to a host buffer as it
    is decoded: the device holds one sample's pixels (a whole Wan 480p x 81-frame unit held ~0.39 GB
    per sample per copy), and the result equals the batched decode (the VAE slices the batch)."""
    out = None
    for i in range(len(latents)):
        pixels = adapter.decode(latents[i : i + 1])
        if out is None:
            out = torch.empty((len(latents), *pixels.shape[1:]), dtype=pixels.dtype)
        out[i].copy_(pixels[0])
        del pixels
    return out if out is not None else adapter.decode(latents).cpu()
