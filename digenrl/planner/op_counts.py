"""Kernels per transformer call and their memory-bound traffic, counted on the real diffusers classes.

A forward's fixed cost (launches, Python, dispatch) grows with the ops it runs, not with its width;
its memory-bound ops (norms, adaLN modulation, activations, residuals, RoPE) move elements per token
x hidden. Both are counted once per family on its tiny preset (the same classes and block kinds as
the published model) under a ``TorchDispatchMode``, per block kind and outside the blocks, and
scaled to a published shape by its block counts (the class on the meta device) and token x hidden.
The counts ship as ``op_counts.json`` (``python -m digenrl.planner.op_counts --write``); a test
recounts them. docs/scaling.md, "The cost model's terms".
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import diffusers
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from digenrl.adapters import adapter_class, build_adapter
from digenrl.config.run import load_config
from digenrl.planner.shapes import _init_args, model_shape

FILE = Path(__file__).with_name("op_counts.json")
ROOT = Path(__file__).resolve().parents[2]
#: the tiny config each family is counted on (an edit family runs its base family's transformer)
TINY_CONFIGS = {
    "flux": "flux_tiny.yaml",
    "sd3": "sd3_tiny.yaml",
    "qwen_image": "qwen_tiny.yaml",
    "wan": "wan_tiny.yaml",
    "hunyuan_video": "hunyuan_tiny.yaml",
    "z_image": "z_image_tiny.yaml",
    "flux2": "flux2_tiny.yaml",
    "hunyuan_video15": "hunyuan_video15_tiny.yaml",
}
SAME_TRANSFORMER = {
    "flux_kontext": "flux",
    "qwen_image_edit": "qwen_image",
    "wan22": "wan",
    "hunyuan_video15_i2v": "hunyuan_video15",
}
#: ops that launch a matmul-class kernel (compute-bound: priced by FLOPs, not by bytes)
_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product", "_flash_attention")


@dataclass(frozen=True)
class OpCounts:
    """Per transformer call: kernels outside the blocks and per block kind; memory-bound elements moved
    (read + written) per token x hidden, outside the blocks and per block of each kind."""

    outside_ops: int
    block_ops: dict[str, int]
    outside_elems: float
    block_elems: dict[str, float]
    # of those, the kernels a serving engine's fused layers do not launch (vLLM-Omni's transformers: one
    # fused RMSNorm kernel, one QKV projection per stream -- qwen_image_transformer.py:318-354)
    fused_outside_ops: int = 0
    fused_block_ops: dict[str, int] = field(default_factory=dict)

    def per_forward(self, blocks: dict[str, int], fused: bool = False) -> tuple[int, float]:
        """(kernels, memory-bound elements per token x hidden) of one call of a model with ``blocks``
        (block kind -> count); ``fused``: as a serving engine with fused norms and QKV runs it."""
        ops = self.outside_ops + sum(self.block_ops.get(k, 0) * n for k, n in blocks.items())
        if fused:
            ops -= self.fused_outside_ops + sum(self.fused_block_ops.get(k, 0) * n for k, n in blocks.items())
        elems = self.outside_elems + sum(self.block_elems.get(k, 0.0) * n for k, n in blocks.items())
        return ops, elems


def is_matmul(name: str) -> bool:
    return any(m in name for m in _MATMUL)


def launches_kernel(func) -> bool:
    """A view or metadata op (view, transpose, slice, detach, ...) launches nothing."""
    return not func.is_view and func.__name__.split(".")[0] not in {"_to_copy", "lift_fresh", "empty"}


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(y) for y in x)
    return 0


def block_lists(net) -> dict[str, list]:
    """The model's block lists: every ``nn.ModuleList`` attribute of the transformer, by name."""
    return {n: list(m) for n, m in net.named_children() if isinstance(m, nn.ModuleList)}


#: families whose vLLM-Omni transformer fuses its norms and QKV (vllm_omni/diffusion/models/*/ at be81443c:
#: vLLM's RMSNorm and QKVParallelLinear); veRL-Omni serves its rollouts with them
SERVED_FUSED = ("qwen_image", "sd3", "wan", "z_image")
#: projections a serving engine merges into its stream's query projection (one QKV matmul)
_MERGED = {"to_k": "to_q", "to_v": "to_q", "add_k_proj": "add_q_proj", "add_v_proj": "add_q_proj"}


def _fusions(net, where: list[str], total: list[int], fused: dict[str, int]) -> list:
    """Hooks that count what fusion saves: an RMSNorm's kernels but one, a merged projection's all."""
    hooks = []
    for parent in net.modules():
        for name, m in parent.named_children():
            norm = type(m).__name__ == "RMSNorm"
            merged = name in _MERGED and hasattr(parent, _MERGED[name])
            if not (norm or merged):
                continue
            start: list[int] = []
            hooks.append(m.register_forward_pre_hook(lambda *_, s=start: s.append(total[0]) and None))

            def done(*_, s=start, keep=1 if norm else 0):
                k = where[-1]
                fused[k] = fused.get(k, 0) + max(0, total[0] - s.pop() - keep)

            hooks.append(m.register_forward_hook(done))
    return hooks


def count_calls(net, call, tokens_hidden: float) -> OpCounts:
    """Run ``call()`` (one or more calls of ``net``) under a dispatch mode and attribute each kernel to
    the block list it ran in; per-call averages, elements per ``tokens_hidden``."""
    where: list[str] = ["outside"]
    ops: dict[str, int] = {}
    elems: dict[str, float] = {}
    total, fused = [0], {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if launches_kernel(func):
                k = where[-1]
                ops[k] = ops.get(k, 0) + 1
                total[0] += 1
                if not is_matmul(func.__name__):
                    moved = _numel(args) + _numel(list((kwargs or {}).values())) + _numel(out)
                    elems[k] = elems.get(k, 0.0) + moved
            return out

    hooks, calls = _fusions(net, where, total, fused), []
    for name, blocks in block_lists(net).items():
        for b in blocks:
            hooks.append(b.register_forward_pre_hook(lambda *_, n=name: where.append(n) and None))
            hooks.append(b.register_forward_hook(lambda *_: where.pop() and None))
    hooks.append(net.register_forward_pre_hook(lambda *_: calls.append(1)))
    try:
        with Count():
            call()
    finally:
        for h in hooks:
            h.remove()
    n = max(1, len(calls))
    sizes = {k: len(v) for k, v in block_lists(net).items()}
    return OpCounts(
        outside_ops=round(ops.get("outside", 0) / n),
        block_ops={k: round(ops.get(k, 0) / n / sizes[k]) for k in sizes if sizes[k]},
        outside_elems=elems.get("outside", 0.0) / n / tokens_hidden,
        block_elems={k: elems.get(k, 0.0) / n / sizes[k] / tokens_hidden for k in sizes if sizes[k]},
        fused_outside_ops=round(fused.get("outside", 0) / n),
        fused_block_ops={k: round(fused.get(k, 0) / n / sizes[k]) for k in sizes if sizes[k]},
    )


def count_family(family: str) -> OpCounts:
    """Count a family on its tiny preset (the adapter's own velocity call, as the sampler makes it)."""
    cfg = load_config(ROOT / "configs" / TINY_CONFIGS[family])
    torch.manual_seed(0)
    ad = build_adapter(cfg.model, cfg.sampling)
    shape = model_shape(cfg.model)
    cond = ad.encode_prompts(["a red apple"])
    if ad.trims_text:  # per token x hidden at the shape's text: the padded call (no trim to the prompt)
        cond = type(cond)(cond.batched)
    x = torch.randn(1, *ad.latent_shape())
    tokens_hidden = (shape.tokens.x + shape.tokens.text) * shape.adapter.width(shape.config)
    with torch.no_grad():
        return count_calls(ad.transformer, lambda: ad.velocity(x, torch.full((1,), 0.5), cond), tokens_hidden)


def published_blocks(shape) -> dict[str, int]:
    """Block counts of ``shape``'s transformer, read off the real class on the meta device."""
    return _blocks(shape.family, json.dumps(shape.config, sort_keys=True))


@lru_cache(maxsize=32)
def _blocks(family: str, config_json: str) -> dict[str, int]:
    cls = getattr(diffusers, adapter_class(family).transformer_class)
    config = json.loads(config_json)
    with torch.device("meta"):
        net = cls(**{k: v for k, v in config.items() if k in _init_args(cls)})
    return {k: len(v) for k, v in block_lists(net).items()}


@lru_cache(maxsize=1)
def shipped() -> dict[str, OpCounts]:
    data = json.loads(FILE.read_text())
    return {k: OpCounts(**v) for k, v in data["families"].items()}


def family_counts(family: str) -> OpCounts | None:
    """The shipped counts of ``family`` (None: not counted)."""
    return shipped().get(SAME_TRANSFORMER.get(family, family))


def forward_ops(shape, fused: bool = False) -> tuple[int, float] | None:
    """(kernels, memory-bound elements per sample) of one transformer call at ``shape`` (``fused``: as a
    serving engine runs it); None when the family has no counts."""

    counts = family_counts(shape.family)
    if counts is None:
        return None
    base = SAME_TRANSFORMER.get(shape.family, shape.family)
    ops, elems = counts.per_forward(published_blocks(shape), fused and base in SERVED_FUSED)
    return ops, elems * (shape.tokens.x + shape.tokens.text) * shape.adapter.width(shape.config)


def main(argv: list[str]) -> int:
    counts = {f: count_family(f).__dict__ for f in TINY_CONFIGS}
    data = {"torch": torch.__version__, "diffusers": diffusers.__version__, "families": counts}
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if "--write" in argv:
        FILE.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
