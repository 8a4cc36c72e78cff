"""A released text encoder that ``model.offload_text_encoders`` hooked is freed (issue 36, item 11).

accelerate's offload hook replaces the encoder's ``forward`` with a closure over the encoder (a
reference cycle), so dropping the last reference frees nothing until a cyclic collection -- and a
worker that builds inside a frozen-GC window (``gc.freeze``) never collects it: 10-16 GB of host RAM
per lean trainer rank. With the cyclic collector off, the encoder must die by reference counting
alone as soon as ``release_generation_modules`` drops it (on 849bed7 it stayed alive)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import TINY


@pytest.fixture(scope="module")
def adapter():
    from digenrl.adapters import build_adapter
    from digenrl.config.run import load_config

    cfg = load_config(None, TINY)
    return build_adapter(cfg.model, cfg.sampling)


def _encoder():
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
        )
    )


def test_released_hooked_encoders_are_freed_without_the_cyclic_collector(adapter):
    from digenrl.adapters.text_offload import attach_offload_hooks

    adapter.pipe = SimpleNamespace(text_encoder=_encoder(), text_encoder_2=_encoder(), vae=None)
    adapter.offload_hooks = attach_offload_hooks(adapter.pipe, torch.device("cpu"))
    ids = torch.zeros((1, 4), dtype=torch.long)
    adapter.pipe.text_encoder(ids)  # used through its hook, as an encode does
    adapter.pipe.text_encoder_2(ids)
    alive = [weakref.ref(adapter.pipe.text_encoder), weakref.ref(adapter.pipe.text_encoder_2)]
    gc.collect()
    gc.disable()  # a frozen-GC window: only reference counting frees
    try:
        adapter.release_generation_modules()
        assert [r() is None for r in alive] == [True, True], "a released encoder is still alive"
    finally:
        gc.enable()
