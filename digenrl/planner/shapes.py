"""Model shapes for the analytic cost model: transformer config, token counts, FLOPs, parameters.

Where a shape comes from, in order:

1. ``model.pretrained`` is a directory with ``transformer/config.json``: the checkpoint's own config;
2. ``model.preset: tiny``: the adapter's tiny preset (``TINY_TRANSFORMER`` of the family's module);
3. otherwise (a real-scale config whose checkpoint is not on this machine): the published shape of
   the family's reference model in :data:`KNOWN` -- FLUX.1-dev, Wan2.1-T2V-14B, HunyuanVideo (13B),
   Qwen-Image (20B), with the numbers of their diffusers ``config.json`` files.

FLOPs are counted per sample and per transformer pass (one guidance branch) as 2 x multiply-adds of
every linear layer applied per token, plus ``4 n_q n_kv d`` per attention (QK^T and AV), plus the
per-sample modulation layers; norms, RoPE and elementwise work are left out (<1% at real scale,
checked against torch's FlopCounterMode in tests/test_planner.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

# --------------------------------------------------------------------------- the known shapes

#: family -> published shape. ``text_encoder_params`` / ``vae_params`` size the rollout side's
#: extra models (memory, prompt encoding); ``vae_decode_flops_per_px`` is a rough estimate of the
#: VAE decoder's cost per output pixel (per frame for video), from its layer widths.
KNOWN: dict[str, dict] = {
    "flux": dict(
        label="FLUX.1-dev (12B)",
        # black-forest-labs/FLUX.1-dev transformer/config.json
        transformer=dict(attention_head_dim=128, guidance_embeds=True, in_channels=64, joint_attention_dim=4096,
                         num_attention_heads=24, num_layers=19, num_single_layers=38, patch_size=1,
                         pooled_projection_dim=768, axes_dims_rope=[16, 56, 56]),
        vae_spatial=8, vae_temporal=1, vae_params=83.8e6, vae_decode_flops_per_px=6.6e6,
        text_encoder_params=4.76e9 + 0.123e9,  # T5-XXL encoder + CLIP-L
    ),
    "wan": dict(
        label="Wan2.1-T2V-14B",
        # Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json
        transformer=dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16,
                         out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                         cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        vae_spatial=8, vae_temporal=4, vae_params=127e6, vae_decode_flops_per_px=10e6,
        text_encoder_params=5.68e9,  # UMT5-XXL encoder
    ),
    "hunyuan_video": dict(
        label="HunyuanVideo (13B)",
        # hunyuanvideo-community/HunyuanVideo transformer/config.json
        transformer=dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                         num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2,
                         patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096,
                         pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=[16, 56, 56]),
        vae_spatial=8, vae_temporal=4, vae_params=246e6, vae_decode_flops_per_px=20e6,
        text_encoder_params=7.5e9 + 0.123e9,  # LLaVA-LLaMA-3-8B language model + CLIP-L
    ),
    "qwen_image": dict(
        label="Qwen-Image (20B)",
        # Qwen/Qwen-Image transformer/config.json
        transformer=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                         num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                         axes_dims_rope=[16, 56, 56]),
        vae_spatial=8, vae_temporal=1, vae_params=127e6, vae_decode_flops_per_px=10e6,
        text_encoder_params=8.29e9,  # Qwen2.5-VL-7B
    ),
}

TRANSFORMER_CLASS = {
    "flux": "FluxTransformer2DModel",
    "wan": "WanTransformer3DModel",
    "hunyuan_video": "HunyuanVideoTransformer3DModel",
    "qwen_image": "QwenImageTransformer2DModel",
}


@dataclass(frozen=True)
class Tokens:
    x: int  # image / video tokens the transformer sees per sample
    text: int  # text tokens per sample
    latent_elements: int  # fp32 latent numbers per sample (one denoising state)
    pixels: int  # decoded pixels per sample (x frames)


@dataclass
class ModelShape:
    family: str
    config: dict  # the diffusers transformer config
    source: str  # "checkpoint", "tiny preset" or the published model's label
    vae_spatial: int
    vae_temporal: int
    vae_params: float
    vae_decode_flops_per_px: float
    text_encoder_params: float
    tokens: Tokens = field(default=None)  # filled by model_shape()

    @property
    def transformer_class(self) -> str:
        return TRANSFORMER_CLASS[self.family]

    def signature(self) -> dict:
        """Comparable with ``Adapter.model_signature()`` (class and config)."""
        return {"adapter": self.family, "class": self.transformer_class, "config": self.config}


def model_shape(model_cfg) -> ModelShape:
    """The shape of the configured model (see the module docstring for the source order)."""
    family = model_cfg.adapter
    known = KNOWN[family]
    base = dict(vae_spatial=known["vae_spatial"], vae_temporal=known["vae_temporal"], vae_params=known["vae_params"],
                vae_decode_flops_per_px=known["vae_decode_flops_per_px"],
                text_encoder_params=known["text_encoder_params"])
    if model_cfg.pretrained is not None and (Path(model_cfg.pretrained) / "transformer" / "config.json").is_file():
        root = Path(model_cfg.pretrained)
        config = _public(json.loads((root / "transformer" / "config.json").read_text()))
        vae_file = root / "vae" / "config.json"
        if vae_file.is_file():
            base.update(_vae_factors(family, json.loads(vae_file.read_text())))
        shape = ModelShape(family, config, "checkpoint", **base)
    elif model_cfg.preset == "tiny":
        shape = _tiny_shape(family, base)
    else:
        shape = ModelShape(family, dict(known["transformer"]), known["label"], **base)
    shape.tokens = count_tokens(shape, model_cfg)
    return shape


def _public(config: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items() if not k.startswith("_")}


def _vae_factors(family: str, vcfg: dict) -> dict:
    if family == "flux":
        return {"vae_spatial": 2 ** (len(vcfg.get("block_out_channels", [0] * 4)) - 1), "vae_temporal": 1}
    if family == "qwen_image":
        return {"vae_spatial": 2 ** len(vcfg.get("temperal_downsample", [0] * 3)), "vae_temporal": 1}
    if family == "wan":
        return {"vae_spatial": vcfg.get("scale_factor_spatial") or 8, "vae_temporal": vcfg.get("scale_factor_temporal") or 4}
    return {"vae_spatial": vcfg.get("spatial_compression_ratio", 8), "vae_temporal": vcfg.get("temporal_compression_ratio", 4)}


def _tiny_shape(family: str, base: dict) -> ModelShape:
    import importlib

    module = importlib.import_module(f"digenrl.adapters.{family}")
    config = _public(dict(module.TINY_TRANSFORMER))
    base = dict(base, **_vae_factors(family, dict(module.TINY_VAE)), vae_params=0.0, text_encoder_params=0.0,
                vae_decode_flops_per_px=0.0)  # tiny presets decode with a linear preview, embed with a hash table
    return ModelShape(family, config, f"{family} tiny preset", **base)


def count_tokens(shape: ModelShape, model_cfg) -> Tokens:
    c, s, t = shape.config, shape.vae_spatial, shape.vae_temporal
    h, w = model_cfg.height // s, model_cfg.width // s
    text = model_cfg.max_text_len
    if shape.family in ("flux", "qwen_image"):  # packed 2x2 latent patches outside the model
        x = (h // 2) * (w // 2)
        return Tokens(x, text, x * c["in_channels"], model_cfg.height * model_cfg.width)
    frames = model_cfg.frames or 1
    lf = (frames - 1) // t + 1
    if shape.family == "wan":
        pt, ph, pw = c.get("patch_size", (1, 2, 2))
    else:
        pt, ph, pw = c.get("patch_size_t", 1), c.get("patch_size", 2), c.get("patch_size", 2)
    x = (lf // pt) * (h // ph) * (w // pw)
    return Tokens(x, text, c["in_channels"] * lf * h * w, model_cfg.height * model_cfg.width * frames)


# ---------------------------------------------------------------------------------- FLOPs


def forward_flops(shape: ModelShape, tokens: Tokens | None = None) -> float:
    """FLOPs of one transformer pass for ONE sample (a guidance branch; CFG families run two)."""
    c, tk = shape.config, tokens or shape.tokens
    d = c["num_attention_heads"] * c["attention_head_dim"]
    nx, nt = tk.x, tk.text
    n = nx + nt
    f = shape.family
    if f == "flux":
        cin, cout = c["in_channels"], c.get("out_channels") or c["in_channels"]
        n_emb = 3 if c.get("guidance_embeds") else 2  # timestep (+ guidance) + pooled text MLPs
        embed = 2 * cin * d * nx + 2 * c["joint_attention_dim"] * d * nt
        embed += 2 * (n_emb - 1) * (256 * d + d * d) + 2 * (c["pooled_projection_dim"] * d + d * d)
        double = c["num_layers"] * (2 * 12 * d * d * n + 4 * n * n * d + 2 * 2 * 6 * d * d)
        single = c["num_single_layers"] * (2 * 12 * d * d * n + 4 * n * n * d + 2 * 3 * d * d)
        return embed + double + single + 2 * 2 * d * d + 2 * d * cout * nx
    if f == "qwen_image":
        cin, p = c["in_channels"], c.get("patch_size", 2)
        cout = c.get("out_channels") or cin // (p * p)
        embed = 2 * cin * d * nx + 2 * c["joint_attention_dim"] * d * nt + 2 * (256 * d + d * d)
        blocks = c["num_layers"] * (2 * 12 * d * d * n + 4 * n * n * d + 2 * 2 * 6 * d * d)
        return embed + blocks + 2 * 2 * d * d + 2 * d * p * p * cout * nx
    if f == "wan":
        pt, ph, pw = c.get("patch_size", (1, 2, 2))
        pv = pt * ph * pw
        cin, cout, ffn = c["in_channels"], c.get("out_channels") or c["in_channels"], c["ffn_dim"]
        embed = 2 * cin * pv * d * nx + 2 * (c["text_dim"] * d + d * d) * nt
        embed += 2 * (c.get("freq_dim", 256) * d + d * d) + 2 * d * 6 * d
        block = (2 * 4 * d * d * nx + 4 * nx * nx * d  # self-attention
                 + 2 * 2 * d * d * nx + 2 * 2 * d * d * nt + 4 * nx * nt * d  # cross-attention to the text
                 + 2 * 2 * d * ffn * nx)  # FFN
        return embed + c["num_layers"] * block + 2 * d * cout * pv * nx
    if f == "hunyuan_video":
        pv = c.get("patch_size_t", 1) * c.get("patch_size", 2) ** 2
        cin, cout = c["in_channels"], c.get("out_channels") or c["in_channels"]
        r = c.get("mlp_ratio", 4.0)
        per_token = (4 + 2 * r) * d * d  # qkv + out (or proj_out's share) + MLP, per stream
        refiner = 2 * c["text_embed_dim"] * d * nt + 2 * (256 * d + d * d) + c.get("num_refiner_layers", 2) * (
            2 * per_token * nt + 4 * nt * nt * d + 2 * 2 * d * d)
        n_emb = 2 if c.get("guidance_embeds") else 1
        embed = 2 * cin * pv * d * nx + refiner + 2 * n_emb * (256 * d + d * d)
        embed += 2 * (c["pooled_projection_dim"] * d + d * d)
        double = c["num_layers"] * (2 * per_token * n + 4 * n * n * d + 2 * 2 * 6 * d * d)
        single = c["num_single_layers"] * (2 * per_token * n + 4 * n * n * d + 2 * 3 * d * d)
        return embed + double + single + 2 * 2 * d * d + 2 * d * cout * pv * nx
    raise ValueError(f"no FLOP formula for family {f!r}")


def attention_fraction(shape: ModelShape) -> float:
    """Share of a pass's FLOPs in attention score / value products (their backward has no frozen
    weights to skip, so LoRA training pays it twice)."""
    c, tk = shape.config, shape.tokens
    d = c["num_attention_heads"] * c["attention_head_dim"]
    n = tk.x + tk.text
    if shape.family == "wan":
        att = c["num_layers"] * (4 * tk.x * tk.x * d + 4 * tk.x * tk.text * d)
    else:
        layers = c["num_layers"] + c.get("num_single_layers", 0)
        att = layers * 4 * n * n * d
    return min(1.0, att / forward_flops(shape))


def guidance_passes(family: str, guidance: float) -> int:
    """Transformer passes per denoising step: two-pass CFG for Wan and Qwen-Image when g > 1."""
    return 2 if family in ("wan", "qwen_image") and guidance > 1.0 else 1


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCounts:
    total: int  # transformer parameters
    lora: int  # LoRA parameters for the configured targets and rank (0 without LoRA)
    hidden: int  # d
    blocks: int  # transformer blocks (activation memory)


def param_counts(shape: ModelShape, lora_cfg, default_targets: tuple[str, ...]) -> ParamCounts:
    """Exact counts from the real diffusers class instantiated on the meta device (no memory)."""
    targets = tuple(lora_cfg.targets or default_targets) if lora_cfg is not None else ()
    rank = lora_cfg.rank if lora_cfg is not None else 0
    total, lora, missing = _counts(shape.family, json.dumps(shape.config, sort_keys=True), targets, rank)
    if missing:
        from digenrl.errors import UserError

        raise UserError(f"model.lora.targets: {list(missing)} match no linear module of {shape.transformer_class}")
    c = shape.config
    d = c["num_attention_heads"] * c["attention_head_dim"]
    blocks = c["num_layers"] + c.get("num_single_layers", 0)
    return ParamCounts(total, lora, d, blocks)


@lru_cache(maxsize=16)
def _counts(family: str, config_json: str, targets: tuple[str, ...], rank: int) -> tuple[int, int, tuple[str, ...]]:
    import diffusers
    import torch
    from torch import nn

    from digenrl.lora import matching_modules

    config = json.loads(config_json)
    cls = getattr(diffusers, TRANSFORMER_CLASS[family])
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
    lora = sum(rank * (modules[n].in_features + modules[n].out_features) for n in matched
               if isinstance(modules[n], nn.Linear))
    return total, lora, tuple(missing)


def _init_args(cls) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters) - {"self"}
