"""Two transformers that split the denoising steps by noise level (Wan2.2 A14B), held as ONE module.

The rest of DigenRL trains ``adapter.transformer``: one module whose parameters, state dict, LoRA
(peft ``add_adapter``), blocks (FSDP2, activation checkpointing) and compile it reaches. ``Experts``
is that module for a model of two experts: its children are named as the pipeline names them
(``transformer`` for high noise, ``transformer_2`` for low noise), so state-dict keys say which
expert a tensor belongs to. Only the ``trained`` experts get LoRA adapters or gradients; the
others stay frozen. The family's adapter picks the expert per step; ``Experts`` never runs a forward.
"""

from __future__ import annotations

import copy

from torch import nn

#: the pipeline's component names, high-noise expert first
EXPERT_NAMES = ("transformer", "transformer_2")


class Experts(nn.Module):
    def __init__(self, high: nn.Module, low: nn.Module, trained: tuple[str, ...] = EXPERT_NAMES):
        super().__init__()
        self.transformer, self.transformer_2 = high, low
        self.trained = tuple(trained)
        self.requires_grad_(True)  # a frozen expert never reaches the optimizer (LoRA or not)

    def experts(self) -> list[nn.Module]:
        """Both experts, high noise first (their blocks are what FSDP2 shards and checkpointing wraps)."""
        return [self.transformer, self.transformer_2]

    def trained_experts(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.trained]

    @property
    def config(self):
        """The high-noise expert's config (both experts share one architecture)."""
        return self.transformer.config

    @property
    def _keep_in_fp32_modules(self):
        """What diffusers keeps in fp32 in each expert (FSDP2 keeps it so too: distributed/fsdp.py)."""
        return getattr(self.transformer, "_keep_in_fp32_modules", None)

    @property
    def dtype(self):
        return self.transformer.dtype

    def forward(self, *args, **kwargs):
        raise RuntimeError("Experts: call the expert for the step (adapter.forward_pass picks it)")

    # ------------------------------------------------------------------ what training reaches
    def requires_grad_(self, requires_grad: bool = True) -> Experts:
        """Full fine-tuning: gradients on the trained experts only; a frozen expert stays frozen."""
        for name, expert in zip(EXPERT_NAMES, self.experts()):
            expert.requires_grad_(requires_grad and name in self.trained)
        return self

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """LoRA (peft) into each trained expert, the same targets and rank in each."""
        for expert in self.trained_experts():
            expert.add_adapter(copy.deepcopy(adapter_config), adapter_name=adapter_name)

    @property
    def peft_config(self) -> dict:
        return self.trained_experts()[0].peft_config

    def disable_adapters(self) -> None:
        for expert in self.trained_experts():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self.trained_experts():
            expert.enable_adapters()

    def compile(self, *args, **kwargs) -> None:
        for expert in self.experts():
            expert.compile(*args, **kwargs)
