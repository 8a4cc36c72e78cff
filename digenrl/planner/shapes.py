"""Model shapes for the analytic cost model: transformer config, token counts, FLOPs, parameters.

Details: docs/modules.md, `digenrl.planner.shapes`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from digenrl.adapters import adapter_class
from digenrl.adapters.cost_hooks import Tokens
from digenrl.distributed.blocks import transformer_blocks
from digenrl.errors import UserError
from digenrl.policy.lora import matching_modules

__all__ = [
    "ModelShape",
    "ParamCounts",
    "Tokens",
    "attention_fraction",
    "forward_flops",
    "model_shape",
    "param_counts",
]


@dataclass
class ModelShape:
    family: str
    config: dict  # the diffusers transformer config
    source: str  # "checkpoint", "tiny preset" or the published model's label
    vae_params: float
    vae_decode_flops_per_px: float
    text_encoder_params: float
    tokens: Tokens = field(default=None)  # filled by model_shape()
    text_source: str = "the adapter at model.max_text_len"  # where tokens.text comes from (text_tokens.py)
    experts: int = 1  # transformers of this config held in memory (Wan2.2 A14B: 2, one runs per step)
    trained_experts: int = 1  # of them, the ones that train

    @property
    def adapter(self):
        """The family's adapter class (its cost hooks)."""
        return adapter_class(self.family)

    @property
    def transformer_class(self) -> str:
        return self.adapter.transformer_class

    def signature(self) -> dict:
        """Comparable with ``Adapter.model_signature()`` (class and config)."""
        return {"adapter": self.family, "class": self.transformer_class, "config": self.config}


def model_shape(model_cfg) -> ModelShape:
    """The shape of the configured model (see the module docstring for the source order)."""
    adapter = adapter_class(model_cfg.adapter)
    ref = adapter.published_model(model_cfg)
    sizes = dict(
        vae_params=ref.vae_params,
        vae_decode_flops_per_px=ref.vae_decode_flops_per_px,
        text_encoder_params=ref.text_encoder_params,
    )
    checkpoint = _checkpoint_configs(model_cfg.pretrained)
    if checkpoint is not None:
        (config, vae), source = checkpoint, "checkpoint"
        vae = vae if vae is not None else ref.vae
    elif model_cfg.preset in adapter.presets:  # tiny (wan22: tiny, tiny_5b)
        (config, vae), source = (
            adapter.presets[model_cfg.preset],
            f"{model_cfg.adapter} {model_cfg.preset} preset",
        )
        # tiny presets decode with a linear preview and embed prompts with a hash table
        sizes = dict(vae_params=0.0, vae_decode_flops_per_px=0.0, text_encoder_params=0.0)
    else:
        config, vae, source = ref.transformer, ref.vae, ref.label
    experts = dict(
        experts=adapter.experts_held(model_cfg), trained_experts=adapter.experts_trained(model_cfg)
    )
    shape = ModelShape(model_cfg.adapter, _public(config), source, **sizes, **experts)
    shape.tokens = adapter.tokens(model_cfg, shape.config, dict(vae))
    return shape


def _checkpoint_configs(pretrained) -> tuple[dict, dict | None] | None:
    """(transformer, VAE or None) configs of a local checkpoint directory, None without one."""
    if pretrained is None or not (Path(pretrained) / "transformer" / "config.json").is_file():
        return None
    root = Path(pretrained)
    vae_file = root / "vae" / "config.json"
    vae = json.loads(vae_file.read_text()) if vae_file.is_file() else None
    return json.loads((root / "transformer" / "config.json").read_text()), vae


def _public(config: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------- FLOPs


def forward_flops(shape: ModelShape, tokens: Tokens | None = None) -> float:
    """FLOPs of one transformer pass for ONE sample (a guidance branch; CFG families run two)."""
    return shape.adapter.forward_flops(shape.config, tokens or shape.tokens)


def attention_fraction(shape: ModelShape) -> float:
    """Share of a pass's FLOPs in attention score / value products (their backward has no frozen
    weights to skip, so LoRA training pays it twice)."""
    return min(1.0, shape.adapter.attention_flops(shape.config, shape.tokens) / forward_flops(shape))


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCounts:
    total: int  # transformer parameters (every expert held)
    lora: int  # LoRA parameters for the configured targets and rank (0 without LoRA), trained experts
    hidden: int  # d
    blocks: int  # transformer blocks one pass runs (activation memory)
    experts: int = 1  # transformers held (total / experts: one expert's parameters)
    frozen: int = 0  # parameters of the experts that do not train
    lora_tensors: int = 0  # LoRA A and B matrices of the trained experts
    gathered: int = (
        0  # FSDP2's peak whole copy in a forward: the 2 largest blocks + the root's own (0: unknown)
    )


def param_counts(shape: ModelShape, lora_cfg, default_targets: tuple[str, ...]) -> ParamCounts:
    """Exact counts from the real diffusers class instantiated on the meta device (no memory)."""
    targets = tuple(lora_cfg.targets or default_targets) if lora_cfg is not None else ()
    rank = lora_cfg.rank if lora_cfg is not None else 0
    total, lora, modules, missing, gathered = _counts(
        shape.family, json.dumps(shape.config, sort_keys=True), targets, rank
    )
    if missing:
        raise UserError(
            f"model.lora.targets: {list(missing)} match no linear module of {shape.transformer_class}"
        )
    c = shape.config
    n, trained = shape.experts, shape.trained_experts  # every expert has the same architecture
    family = shape.adapter
    return ParamCounts(
        n * total,
        trained * lora,
        family.width(c),
        family.blocks(c),
        n,
        (n - trained) * total,
        2 * trained * modules,
        gathered,
    )


@lru_cache(maxsize=16)
def _counts(
    family: str, config_json: str, targets: tuple[str, ...], rank: int
) -> tuple[int, int, int, tuple[str, ...]]:
    import diffusers
    import torch
    from torch import nn

    config = json.loads(config_json)
    cls = getattr(diffusers, adapter_class(family).transformer_class)
    with torch.device("meta"):
        net = cls(**{k: v for k, v in config.items() if k in _init_args(cls)})
    total = sum(p.numel() for p in net.parameters())
    matched, missing = set(), []
    for t in targets:
        names = matching_modules(net, t)
        if not names:
            missing.append(t)
        matched.update(names)
    modules = dict(net.named_modules())
    linear = [modules[n] for n in matched if isinstance(modules[n], nn.Linear)]
    lora = sum(rank * (m.in_features + m.out_features) for m in linear)
    return total, lora, len(linear) if rank else 0, tuple(missing), gathered_params(net)


def gathered_params(net) -> int:
    """What FSDP2 holds whole at once in a forward of ``net`` sharded per block: the running block and
    the prefetched next (the two largest), and the root's own parameters (embedders, final layers)."""
    blocks = transformer_blocks(net)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    sizes = sorted((sum(p.numel() for p in b.parameters()) for b in blocks), reverse=True)
    return sum(sizes[:2]) + sum(p.numel() for p in net.parameters() if id(p) not in in_blocks)


def _init_args(cls) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters) - {"self"}
