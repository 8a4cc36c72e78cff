"""The planner's memory model beside a measurement, per real-scale config (docs/scaling.md,
"Memory model vs measurement").

For each config: the family's real transformer class at REAL WIDTH (hidden size, heads, FFN, text
width) but one block of each kind, random init on the CPU in the config's dtype, with the config's
LoRA. Measured: parameter bytes, the fp32 LoRA masters and AdamW state after one real step, and the
bytes autograd saves (``saved_tensors_hooks``, one count per storage, parameters excluded) for ONE
sample through each block, one guidance pass, with and without activation checkpointing, at a
reduced token count with the real image : text ratio (``BENCH_IMAGE_TOKENS``). Extrapolated: per
block to the real depth, and linearly in tokens to the config's token count (attention saves
O(tokens): flash / memory-efficient kernels keep the log-sum-exp, not the scores). Predicted: the
same component from :class:`~digenrl.planner.memory.MemoryModel`.

    python benchmarks/memory.py --json memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

CONFIGS = (
    "configs/flux1_dev.yaml",
    "configs/wan2.1_t2v_14b_240p.yaml",
    "configs/hunyuan_video.yaml",
    "configs/qwen_image.yaml",
)
BENCH_IMAGE_TOKENS = 256  # image tokens per sample in the measurement (text tokens: the real ratio, >= 8)
GiB = 2**30


class SavedBytes:
    """Bytes autograd saves while each block runs, per block: one count per storage over the whole
    forward (a tensor every block uses -- rotary tables, the time embedding -- counts in the first),
    parameters excluded (their storage exists anyway)."""

    def __init__(self, blocks, params):
        self.per_block = [0] * len(blocks)
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._current, self._seen = None, set()
        self.handles = []
        for i, b in enumerate(blocks):
            self.handles.append(b.register_forward_pre_hook(self._enter(i)))
            self.handles.append(b.register_forward_hook(self._leave))

    def _enter(self, i):
        def hook(module, args):
            if self._current is None:
                self._current = i

        return hook

    def _leave(self, module, args, output):
        self._current = None

    def pack(self, t):
        s = t.untyped_storage()
        key = s.data_ptr()
        if self._current is not None and key not in self._params and key not in self._seen:
            self._seen.add(key)
            self.per_block[self._current] += s.nbytes()
        return t

    def close(self):
        for h in self.handles:
            h.remove()


def reduced_config(family: str, config: dict) -> tuple[dict, dict]:
    """(the config with two blocks of each kind, real block counts by kind). The second block of a
    kind is the one measured: the first also holds what all blocks share, and the last block's
    text-stream output feeds nothing (no gradient for its text-side LoRA)."""
    real = {"blocks": config["num_layers"], "single": config.get("num_single_layers", 0)}
    small = dict(config, num_layers=2)
    if "num_single_layers" in config:
        small["num_single_layers"] = 2
    return small, real


def grid(tokens: int) -> tuple[int, int]:
    side = int(round(tokens**0.5))
    return side, tokens // side


def inputs(family: str, c: dict, x_tokens: int, text: int, dtype) -> dict:
    """One sample's forward inputs (NOTES.md "Forward inputs") with about ``x_tokens`` image tokens."""
    h, w = grid(x_tokens)
    if family in ("flux", "qwen_image"):
        hs = torch.randn(1, h * w, c["in_channels"], dtype=dtype)
        enc = torch.randn(1, text, c["joint_attention_dim"], dtype=dtype)
        if family == "flux":
            ids = torch.stack(
                torch.meshgrid(torch.zeros(1), torch.arange(h * 1.0), torch.arange(w * 1.0), indexing="ij"),
                -1,
            ).reshape(h * w, 3)
            return dict(
                hidden_states=hs,
                encoder_hidden_states=enc,
                pooled_projections=torch.randn(1, c["pooled_projection_dim"], dtype=dtype),
                timestep=torch.rand(1),
                guidance=torch.full((1,), 3.5),
                img_ids=ids,
                txt_ids=torch.zeros(text, 3),
                return_dict=False,
            )
        return dict(
            hidden_states=hs,
            encoder_hidden_states=enc,
            encoder_hidden_states_mask=None,
            timestep=torch.rand(1).to(dtype),
            img_shapes=[[(1, h, w)]],
            return_dict=False,
        )
    p = c["patch_size"][-1] if isinstance(c["patch_size"], (list, tuple)) else c["patch_size"]
    hs = torch.randn(1, c["in_channels"], 1, h * p, w * p, dtype=dtype)
    if family == "wan":
        return dict(
            hidden_states=hs,
            timestep=torch.rand(1) * 1000,
            encoder_hidden_states=torch.randn(1, text, c["text_dim"], dtype=dtype),
            return_dict=False,
        )
    return dict(
        hidden_states=hs,
        timestep=torch.rand(1) * 1000,
        encoder_hidden_states=torch.randn(1, text, c["text_embed_dim"], dtype=dtype),
        encoder_attention_mask=torch.ones(1, text, dtype=torch.long),
        pooled_projections=torch.randn(1, c["pooled_projection_dim"], dtype=dtype),
        guidance=torch.full((1,), 3500.0),
        return_dict=False,
    )


def kind_of(name: str) -> tuple[str | None, int]:
    """(block kind, index in its list) of a parameter name; (None, 0) outside the blocks."""
    for prefix, kind in (
        ("single_transformer_blocks.", "single"),
        ("transformer_blocks.", "blocks"),
        ("blocks.", "blocks"),
    ):
        if name.startswith(prefix):
            return kind, int(name[len(prefix) :].split(".")[0])
    return None, 0


def by_kind(named_bytes, real: dict) -> float:
    """Bytes at the real depth: outside the blocks once, the first block of each kind x its real count."""
    total = 0.0
    for name, nbytes in named_bytes:
        k, i = kind_of(name)
        total += 0 if i else nbytes * (real[k] if k else 1)
    return total


def measure(cfg_path: str) -> list[dict]:
    import diffusers

    from digenrl.adapters import adapter_class
    from digenrl.adapters.base import seeded
    from digenrl.config.run import load_config
    from digenrl.distributed.blocks import transformer_blocks
    from digenrl.distributed.checkpointing import checkpoint_blocks
    from digenrl.distributed.precision import fp32_master
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.params import CostParams
    from digenrl.planner.workload import Workload
    from digenrl.policy.lora import apply_lora

    cfg = load_config(cfg_path, [])
    family = cfg.model.adapter
    adapter = adapter_class(family)
    w = Workload.from_config(cfg)
    model = MemoryModel(w, CostParams())
    dtype = getattr(torch, cfg.model.dtype)
    small, real = reduced_config(family, dict(w.shape.config))
    real_tokens = w.shape.tokens.x + w.shape.tokens.text
    text = max(8, round(BENCH_IMAGE_TOKENS * w.shape.tokens.text / w.shape.tokens.x))
    cls = getattr(diffusers, adapter.transformer_class)
    accepted = set(__import__("inspect").signature(cls.__init__).parameters)
    with seeded(0):
        net = cls(**{k: v for k, v in small.items() if k in accepted}).to(dtype)
    weights = by_kind(((n, p.numel() * p.element_size()) for n, p in net.named_parameters()), real)
    if cfg.model.lora is not None:
        apply_lora(net, cfg.model.lora, adapter.default_lora_targets)
    else:
        net.requires_grad_(True)
    fp32_master(net)
    blocks = transformer_blocks(net)
    kinds = [
        "single" if b.__class__.__name__.startswith(("FluxSingle", "HunyuanVideoSingle")) else "blocks"
        for b in blocks
    ]
    x = inputs(family, small, BENCH_IMAGE_TOKENS, text, dtype)
    bench_tokens = x_tokens(family, small, x) + text
    scale = real_tokens / bench_tokens

    def forward(recorder, net):  # net as an argument: a closure would name the variable deleted below
        with (
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t),
            torch.autocast("cpu", dtype=dtype),
        ):
            out = net(**x)[0]
        recorder.close()
        return out.float().square().mean()

    plain = SavedBytes(blocks, net.parameters())
    loss = forward(plain, net)
    loss.backward()
    del loss
    trained = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trained], lr=1e-5)
    opt.step()
    state = by_kind(
        (
            (
                n,
                sum(
                    v.numel() * v.element_size()
                    for v in opt.state[p].values()
                    if torch.is_tensor(v) and v.dim() > 0
                ),
            )
            for n, p in trained
        ),
        real,
    )
    masters = by_kind(((n, p.numel() * p.element_size()) for n, p in trained), real)
    opt.zero_grad(set_to_none=True)
    del opt
    checkpoint_blocks(net)
    ckpt = SavedBytes(blocks, net.parameters())
    loss = forward(ckpt, net)
    del loss
    second = {k: i for i, k in enumerate(kinds)}  # the last (second) block of each kind
    act_off = sum(plain.per_block[i] * real[k] for k, i in second.items()) * scale
    act_on = (
        sum(ckpt.per_block[i] * real[k] for k, i in second.items())
        + max(plain.per_block[i] for i in second.values())
    ) * scale
    parts = model.train_parts(1, 1, False)
    rows = [
        ("weights (model dtype)", model.rollout_parts(1)["weights"], weights),
        ("fp32 trained masters", parts["fp32 masters"], masters),
        ("AdamW state", parts["AdamW state"], state),
        ("activations / sample / pass, ckpt off", model.train_acts(1, False) / w.passes, act_off),
        ("activations / sample / pass, ckpt on", model.train_acts(1, True) / w.passes, act_on),
    ]
    del net, blocks
    gc.collect()
    name = cfg_path.rsplit("/", 1)[-1]
    out = []
    for component, predicted, measured in rows:
        out.append(
            {
                "config": name,
                "component": component,
                "predicted_gib": predicted / GiB,
                "measured_gib": measured / GiB,
                "rel_error": (predicted - measured) / measured if measured else None,
            }
        )
    print(
        f"{name}: {bench_tokens} tokens measured (x{scale:.1f} to the config's {real_tokens}), "
        f"per block saved (ckpt off / on) {[round(b / 2**20, 1) for b in plain.per_block]} / "
        f"{[round(b / 2**20, 2) for b in ckpt.per_block]} MiB; act bytes per token x hidden "
        f"{act_off / scale / bench_tokens / w.params.hidden / w.params.blocks:.2f}",
        flush=True,
    )
    return out


def x_tokens(family: str, c: dict, x: dict) -> int:
    hs = x["hidden_states"]
    if hs.dim() == 3:
        return hs.shape[1]
    p = c["patch_size"][-1] if isinstance(c["patch_size"], (list, tuple)) else c["patch_size"]
    return hs.shape[2] * (hs.shape[3] // p) * (hs.shape[4] // p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = ap.parse_args()
    torch.manual_seed(0)
    start, rows = time.perf_counter(), []
    for c in args.configs:
        rows += measure(c)
    print(f"{'config':<24} {'component':<40} {'predicted':>10} {'measured':>10} {'error':>7}")
    for r in rows:
        err = f"{r['rel_error']:+.1%}" if r["rel_error"] is not None else "n/a"
        print(
            f"{r['config']:<24} {r['component']:<40} {r['predicted_gib']:>10.3f} {r['measured_gib']:>10.3f} "
            f"{err:>7}"
        )
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
