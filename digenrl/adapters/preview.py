"""Latent-to-RGB preview decoder used by the tiny presets instead of their random-init VAE.

Details: docs/modules.md, `digenrl.adapters.preview`.
"""

from __future__ import annotations

import torch


class LatentRGBDecoder:
    def __init__(self, latent_channels: int, spatial: int, temporal: int = 1, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(3, latent_channels, generator=g) / latent_channels**0.5
        self.spatial, self.temporal = spatial, temporal

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, 3, H*s, W*s); (N, C, F, H, W) -> (N, 3, 1 + t*(F-1), H*s, W*s), in [0, 1]."""
        w = self.weight.to(latents.device)
        rgb = torch.sigmoid(2 * torch.einsum("rc,nc...->nr...", w, latents.float()))
        rgb = rgb.repeat_interleave(self.spatial, dim=-1).repeat_interleave(self.spatial, dim=-2)
        if rgb.ndim == 5 and self.temporal > 1:  # causal video VAEs: first latent frame -> 1 frame
            rgb = torch.cat([rgb[:, :, :1], rgb[:, :, 1:].repeat_interleave(self.temporal, dim=2)], dim=2)
        return rgb
