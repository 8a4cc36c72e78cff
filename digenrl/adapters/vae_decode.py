"""How an adapter's VAE decodes a batch (``sampling.vae_tiling``): one sample at a time, tiled where
configured or where a sample is larger than the decode tile (:data:`TILE_PX`).

Details: docs/modules.md, `digenrl.adapters.vae_decode`.
"""

from __future__ import annotations

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
