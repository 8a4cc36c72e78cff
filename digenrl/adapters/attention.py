"""The attention kernels a transformer call may use: every one of PyTorch's but cuDNN's, by default.

On one H200 (torch 2.11.0+cu130, 2026-12-04) cuDNN's attention backward failed on the first train
step of a FLUX-width transformer in bf16 (``mha_graph.execute(...).is_good()``, reported late as a
cuBLAS error), for fp32 masters, bf16 and LoRA alike; without it the step trains, and sampling is as
fast (benchmarks/gpu_runs/2026-12-04-h200, docs/real_scale.md). ``model.cudnn_attention`` allows it.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_lock = threading.Lock()
_inside = 0  # calls in this process inside the context (threads may overlap: the last one out restores)
_before = True  # torch's cuDNN-attention flag when the first of them entered


@contextlib.contextmanager
def attention_kernels(cudnn: bool):
    """Keeps ``scaled_dot_product_attention`` off cuDNN's kernel unless ``cudnn``; every other kernel
    choice stays the caller's (an outer ``sdpa_kernel`` still holds). The forward's kernel fixes the
    backward's, and rollout and trainer pick alike, so their log-probs agree."""
    global _inside, _before
    if cudnn:
        yield
        return
    with _lock:
        if _inside == 0:
            _before = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                torch.backends.cuda.enable_cudnn_sdp(_before)
