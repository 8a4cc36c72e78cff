"""Deterministic stand-in text encoder for the tiny presets (no tokenizer or weights to download).

Details: docs/modules.md, `digenrl.adapters.tiny_text`.
"""

from __future__ import annotations

import zlib

import torch


class HashTextEncoder:
    def __init__(self, dim: int, max_len: int, pooled_dim: int | None = None, seed: int = 0):
        self.dim, self.max_len, self.pooled_dim, self.seed = dim, max_len, pooled_dim or dim, seed

    def _word(self, word: str, dim: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(word.encode()) + 7919 * self.seed + dim)
        return torch.randn(dim, generator=g)

    def tokens(self, prompt: str) -> list[str]:
        return prompt.lower().replace(",", " ").replace(".", " ").split()[: self.max_len]

    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Returns ``embeds`` (B, max_len, dim), ``mask`` (B, max_len; valid tokens a left-aligned
        prefix) and ``pooled`` (B, pooled_dim, mean of the words' pooled vectors)."""
        embeds = torch.zeros(len(prompts), self.max_len, self.dim)
        mask = torch.zeros(len(prompts), self.max_len, dtype=torch.long)
        pooled = torch.zeros(len(prompts), self.pooled_dim)
        for i, prompt in enumerate(prompts):
            words = self.tokens(prompt) or ["<empty>"]
            for j, w in enumerate(words):
                embeds[i, j] = self._word(w, self.dim)
                pooled[i] += self._word(w, self.pooled_dim) / len(words)
            mask[i, : len(words)] = 1
        return {"embeds": embeds, "mask": mask, "pooled": pooled}
