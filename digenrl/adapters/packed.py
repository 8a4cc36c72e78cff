"""Shared by the image families that pack 2x2 latent patches into tokens (FLUX.1, Qwen-Image).

Latents (B, C, H, W) become (B, H/2*W/2, 4C) tokens, and the sigma schedule is
``linspace(1, 1/N, N)`` shifted by ``mu``, linear in the number of image tokens (``calculate_shift``).
"""

from __future__ import annotations

import torch

from digenrl.adapters.base import Adapter


def calculate_shift(seq_len: int, base_len: int, max_len: int, base_shift: float, max_shift: float) -> float:
    """Resolution-dependent shift mu: linear in the number of image tokens (as the pipelines)."""
    m = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * m + base_shift - m * base_len


class PackedLatentAdapter(Adapter):
    @property
    def vae_scale(self) -> int:
        """Spatial compression of the VAE (as the pipeline's ``vae_scale_factor``)."""
        return self.vae_factors(self.vae.config)[0]

    @staticmethod
    def grid(model, vae_scale: int) -> tuple[int, int]:
        """Packed token grid (rows, cols): 2x2 latent patches."""
        return model.height // vae_scale // 2, model.width // vae_scale // 2

    def _grid(self) -> tuple[int, int]:
        return self.grid(self.cfg, self.vae_scale)

    @classmethod
    def latent_shape_for(cls, model, transformer_config, vae_config) -> tuple[int, ...]:
        rows, cols = cls.grid(model, cls.vae_factors(vae_config)[0])
        return (rows * cols, transformer_config["in_channels"])

    @classmethod
    def sequence_tokens(cls, transformer_config, latent_shape) -> int:
        return latent_shape[0]  # one token per packed patch

    def latent_shape(self) -> tuple[int, ...]:
        return self.latent_shape_for(self.cfg, self.transformer.config, self.vae.config)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        c = self.scheduler.config
        mu = calculate_shift(
            self.latent_shape()[0],
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
        return self._set_timesteps(num_steps, mu)

    def to_spatial(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, rows*cols, 4C) tokens -> (B, C, H, W)."""
        rows, cols = self._grid()
        b, _, c = latents.shape
        x = latents.view(b, rows, cols, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c // 4, rows * 2, cols * 2)
