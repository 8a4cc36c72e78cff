"""Decoded pixels, lean on memory: the VAE's output mapped to [0, 1] with one fp32 copy at most, and a
unit decoded one sample at a time into host memory (issue 53, item 6; tests/test_decode_memory.py)."""

from __future__ import annotations

import torch


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
