"""A tiny random-init language model of a family's real text-encoder class behind a hash tokenizer.

The 2025-26 families (Z-Image, FLUX.2) condition on the hidden states of a decoder LM (Qwen3,
Mistral). Their tiny presets build that class from a small ``transformers`` config -- random init,
no download -- and feed it token ids hashed from the prompt's words (a real tokenizer needs its
vocabulary files). Valid tokens are a left-aligned prefix of ``max_len``, padded as the pipelines pad.
"""

from __future__ import annotations

import zlib

import torch

from digenrl.adapters.base import seeded


class TinyLM:
    def __init__(self, model: torch.nn.Module, max_len: int):
        self.model, self.max_len = model.eval(), max_len
        self.vocab = model.config.vocab_size
        # unit-variance word vectors (as tiny_text's): at the LM's own init (std 0.02) the hidden
        # states are too small for the tiny transformers' text projections to tell prompts apart
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(7))

    @classmethod
    def build(
        cls,
        model_cls,
        config_cls,
        hidden: int,
        layers: int,
        max_len: int,
        seed: int = 4321,
        init_std=0.02,
        **extra,
    ):
        """A random-init ``model_cls`` of ``hidden`` width and ``layers`` layers (2 heads, 1 KV head);
        ``init_std``: the config's ``initializer_range`` (the LMs' own 0.02: layers that barely mix the
        tokens; ``hidden ** -0.5``: variance preserving, each token's states carry its context)."""
        config = config_cls(
            vocab_size=512,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=max(64, max_len),
            initializer_range=init_std,
            **extra,
        )
        with seeded(seed):
            return cls(model_cls(config), max_len)

    @classmethod
    def qwen3(cls, hidden: int, layers: int, max_len: int, seed: int = 4321, init_std=0.02) -> TinyLM:
        """``Qwen3Model`` (Z-Image's and FLUX.2 [klein]'s text encoder class), ``hidden`` wide."""
        from transformers import Qwen3Config, Qwen3Model

        return cls.build(
            Qwen3Model, Qwen3Config, hidden, layers, max_len, seed, init_std, head_dim=hidden // 2
        )

    @classmethod
    def mistral(cls, hidden: int, layers: int, max_len: int, seed: int = 4321, init_std=0.02) -> TinyLM:
        """``MistralModel``: the language model of FLUX.2 [dev]'s Mistral-Small-3.1 (its vision tower
        is never used for text)."""
        from transformers import MistralConfig, MistralModel

        return cls.build(
            MistralModel, MistralConfig, hidden, layers, max_len, seed, init_std, head_dim=hidden // 2
        )

    @classmethod
    def qwen2_5_vl(cls, hidden: int, layers: int, max_len: int, seed: int = 4321) -> TinyLM:
        """``Qwen2_5_VLTextModel``: HunyuanVideo-1.5's text encoder (Qwen2.5-VL's language model)."""
        from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

        rope = {"type": "default", "mrope_section": [1, 1, 2]}
        return cls.build(
            Qwen2_5_VLTextModel,
            Qwen2_5_VLTextConfig,
            hidden,
            layers,
            max_len,
            seed,
            rope_scaling=rope,
            bos_token_id=None,
            eos_token_id=None,
        )

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask), both (B, max_len) long; a word's id is its CRC32 (0 is padding)."""
        ids = torch.zeros(len(prompts), self.max_len, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            words = prompt.lower().replace(",", " ").replace(".", " ").split()[: self.max_len] or ["<empty>"]
            ids[i, : len(words)] = torch.tensor(
                [zlib.crc32(w.encode()) % (self.vocab - 1) + 1 for w in words]
            )
            mask[i, : len(words)] = 1
        return ids, mask

    @torch.no_grad()
    def hidden_states(self, prompts: list[str]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Every layer's hidden states (as ``output_hidden_states=True``) and the mask."""
        ids, mask = self.tokenize(prompts)
        device = next(self.model.parameters()).device
        out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        return out.hidden_states, mask.to(device)
