"""Adapter registry: model family name -> adapter class (imported lazily; diffusers is heavy)."""

from __future__ import annotations

import functools
import importlib

from digenrl.errors import UserError

#: family name -> "module:Class"
ADAPTERS: dict[str, str] = {
    "flux": "digenrl.adapters.flux:FluxAdapter",
    "flux2": "digenrl.adapters.flux2:Flux2Adapter",
    "wan": "digenrl.adapters.wan:WanAdapter",
    "hunyuan_video": "digenrl.adapters.hunyuan_video:HunyuanVideoAdapter",
    "hunyuan_video15": "digenrl.adapters.hunyuan_video15:HunyuanVideo15Adapter",
    "qwen_image": "digenrl.adapters.qwen_image:QwenImageAdapter",
    "sd3": "digenrl.adapters.sd3:SD3Adapter",
    "wan22": "digenrl.adapters.wan22:Wan22Adapter",
    "z_image": "digenrl.adapters.z_image:ZImageAdapter",
    # image editing: a prompt row carries an input image (adapters/edit.py)
    "flux_kontext": "digenrl.adapters.flux_kontext:FluxKontextAdapter",
    "qwen_image_edit": "digenrl.adapters.qwen_image_edit:QwenImageEditAdapter",
    # image to video: a prompt row carries the first frame
    "hunyuan_video15_i2v": "digenrl.adapters.hunyuan_video15_i2v:HunyuanVideo15I2VAdapter",
}


@functools.cache
def adapter_class(name: str):
    if name not in ADAPTERS:
        raise UserError(f"model.adapter: unknown adapter '{name}' (available: {', '.join(sorted(ADAPTERS))})")
    module, cls = ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_adapter(model_cfg, sampling_cfg, device="cpu", generates: bool = True, host_transformer=False):
    """``generates=False``: a rank that never encodes or decodes (a checkpoint's transformer alone);
    ``host_transformer``: a rank that will shard keeps the transformer in host memory (FSDP2 moves it
    to ``device`` one block at a time: ``distributed.fsdp.parallelize``)."""
    return adapter_class(model_cfg.adapter)(model_cfg, sampling_cfg, device, generates, host_transformer)
