"""Text encoders kept on the CPU between encodes (``model.offload_text_encoders``).

Details: docs/modules.md, `digenrl.adapters.text_offload`.
"""

from __future__ import annotations

import torch
from torch import nn

TEXT_ENCODER_PARTS = ("text_encoder", "text_encoder_2")


def attach_offload_hooks(pipe, device: torch.device) -> list:
    """Move ``pipe``'s text encoders to the CPU and hook them to run on ``device``; the hooks, in order."""
    from accelerate import cpu_offload_with_hook

    hooks = []
    for name in TEXT_ENCODER_PARTS:
        encoder = getattr(pipe, name, None) if pipe is not None else None
        if isinstance(encoder, nn.Module):
            _, hook = cpu_offload_with_hook(
                encoder, execution_device=device, prev_module_hook=hooks[-1] if hooks else None
            )
            hooks.append(hook)
    return hooks


def offload_all(hooks: list) -> None:
    """Every hooked encoder back to the CPU (a no-op for those already there)."""
    for hook in hooks:
        hook.offload()
    if hooks and torch.cuda.is_available():
        torch.cuda.empty_cache()


def detach_offload_hooks(pipe) -> None:
    """Remove the offload hooks from ``pipe``'s text encoders (their own ``forward`` back)."""
    from accelerate.hooks import remove_hook_from_module

    for name in TEXT_ENCODER_PARTS:
        encoder = getattr(pipe, name, None) if pipe is not None else None
        if isinstance(encoder, nn.Module) and hasattr(encoder, "_hf_hook"):
            remove_hook_from_module(encoder, recurse=True)
            for module in encoder.modules():  # accelerate puts back ``module.forward = <bound method>``:
                bound = module.__dict__.get("forward")  # a cycle too; the class's own is the same method
                if getattr(bound, "__self__", None) is module:
                    del module.__dict__["forward"]
