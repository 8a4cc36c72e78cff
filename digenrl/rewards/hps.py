"""``hpsv2``: HPSv2 / HPSv2.1 (Wu et al. 2023), an OpenCLIP ViT-H/14 fine-tuned on human preferences,
from the checkpoint file it ships (``HPS_v2.1_compressed.pt``: ``{"state_dict": <open_clip keys>}``),
loaded into transformers' ``CLIPModel`` by a key conversion (no open_clip / torchvision needed). The
score is HPSv2's ``img_score.score``: the cosine of the normalised image and text features.
"""

from __future__ import annotations

import html
from pathlib import Path

import torch
import torch.nn.functional as F

from digenrl.errors import relative_note
from digenrl.rewards.base import RewardArgError, register
from digenrl.rewards.clip_models import (
    DTYPES,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ClipBackbone,
    _ClipReward,
    _device,
    batch_size_arg,
    device_name,
    read_state_dict,
)

#: open_clip's model configs (``model_configs/<name>.json``) for the checkpoints HPS ships on
ARCHS = {
    "ViT-H-14": dict(
        embed_dim=1024, image_size=224, patch_size=14, vision_width=1280, vision_layers=32,
        vision_heads=16, text_width=1024, text_layers=24, text_heads=16,
    ),
    "ViT-L-14": dict(
        embed_dim=768, image_size=224, patch_size=14, vision_width=1024, vision_layers=24,
        vision_heads=16, text_width=768, text_layers=12, text_heads=12,
    ),
}  # fmt: skip
ARCH_DEFAULTS = dict(context_length=77, vocab_size=49408, mlp_ratio=4.0, quick_gelu=False)

_BLOCK = {  # open_clip ResidualAttentionBlock -> transformers CLIPEncoderLayer
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
    "attn.out_proj": "self_attn.out_proj",
}
_TOP = {
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
}


def convert_open_clip(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
    """open_clip CLIP keys -> {transformers CLIPModel key: (open_clip key, tensor)}. The fused
    attention input projection is split into q, k, v; ``x @ proj`` matrices become Linear weights
    (transposed). A key with no counterpart maps to itself (and fails the strict load)."""
    out = {}
    for key, t in state.items():
        if key in _TOP:
            out[_TOP[key]] = (key, t)
        elif key in ("text_projection", "visual.proj"):
            out["text_projection.weight" if key == "text_projection" else "visual_projection.weight"] = (
                key,
                t.T,
            )
        elif ".resblocks." in key:
            tower, rest = key.split("transformer.resblocks.", 1)
            index, name = rest.split(".", 1)
            prefix = f"{'vision' if tower == 'visual.' else 'text'}_model.encoder.layers.{index}.self_attn."
            if name.startswith("attn.in_proj_"):  # (3d, d) / (3d,) -> q, k, v
                kind = name.rsplit("_", 1)[1]
                for part, chunk in zip("qkv", t.chunk(3)):
                    out[f"{prefix}{part}_proj.{kind}"] = (key, chunk)
                continue
            sub, leaf = name.rsplit(".", 1)
            new = _BLOCK.get(sub)
            out[f"{prefix.removesuffix('self_attn.')}{new}.{leaf}" if new else key] = (key, t)
        else:
            out[key] = (key, t)
    return out


def _arch(arch) -> tuple[str, dict]:
    if isinstance(arch, str):
        if arch not in ARCHS:
            raise RewardArgError("arch", f"unknown {arch!r} (known: {', '.join(ARCHS)}, or a mapping)")
        return arch, ARCH_DEFAULTS | ARCHS[arch]
    needed = set(ARCHS["ViT-H-14"])
    if not isinstance(arch, dict) or not needed <= set(arch):
        raise RewardArgError(
            "arch", f"a name ({', '.join(ARCHS)}) or a mapping with {', '.join(sorted(needed))}"
        )
    return "the given arch", ARCH_DEFAULTS | arch


def _clip_config(a: dict, tokenizer):
    from transformers import CLIPConfig

    act = "quick_gelu" if a["quick_gelu"] else "gelu"

    def tower(width: int, layers: int, heads: int) -> dict:
        return dict(
            hidden_size=width, intermediate_size=int(width * a["mlp_ratio"]), num_hidden_layers=layers,
            num_attention_heads=heads, hidden_act=act, layer_norm_eps=1e-5,
        )  # fmt: skip

    text = tower(a["text_width"], a["text_layers"], a["text_heads"]) | dict(
        vocab_size=a["vocab_size"], max_position_embeddings=a["context_length"],
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )  # fmt: skip
    vision = tower(a["vision_width"], a["vision_layers"], a["vision_heads"])
    vision |= dict(image_size=a["image_size"], patch_size=a["patch_size"])
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=a["embed_dim"])


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The open_clip state dict in an HPS checkpoint (``{"state_dict": ...}``, DDP's ``module.``
    prefix dropped) or a bare state dict (.pt / .bin / .safetensors)."""
    state = read_state_dict(path, "path")
    return {k.removeprefix("module."): v for k, v in state.items()}


class OpenClipBackbone(ClipBackbone):
    """An open_clip checkpoint as a ``CLIPModel`` with HPSv2's evaluation preprocessing."""

    def __init__(self, path: Path, tokenizer: Path, arch, device: torch.device, dtype: torch.dtype):
        from transformers import AutoTokenizer, CLIPModel

        name, a = _arch(arch)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RewardArgError("tokenizer", f"no CLIP tokenizer in {tokenizer} ({exc})") from None
        if len(self.tokenizer) > a["vocab_size"]:
            raise RewardArgError(
                "tokenizer", f"{tokenizer} has {len(self.tokenizer)} tokens, the model {a['vocab_size']}"
            )
        with torch.device("meta"):  # shapes checked before any memory is spent
            model = CLIPModel(_clip_config(a, self.tokenizer))
        want = model.state_dict()
        got = convert_open_clip(read_checkpoint(path))
        for key, (src, t) in got.items():
            if key not in want:
                raise RewardArgError(
                    "path", f"{path} is not an open_clip {name} checkpoint: unexpected {src}"
                )
            if t.shape != want[key].shape:
                raise RewardArgError(
                    "path",
                    f"{path} is not an open_clip {name} checkpoint: {src} has shape {tuple(t.shape)}, "
                    f"{name} needs {tuple(want[key].shape)}",
                )
        missing = sorted(k for k in want if k not in got and not k.endswith("position_ids"))
        if missing:
            raise RewardArgError("path", f"{path} is not an open_clip {name} checkpoint: no {missing[0]}")
        model.to_empty(device="cpu").load_state_dict({k: t for k, (_, t) in got.items()}, strict=False)
        for emb in (model.text_model.embeddings, model.vision_model.embeddings):  # the one buffer
            emb.position_ids = torch.arange(emb.position_ids.shape[1]).expand(1, -1)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device, self.dtype = device, dtype
        self.max_length, self.side = a["context_length"], a["image_size"]
        self.mean = torch.tensor(OPENAI_CLIP_MEAN, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(OPENAI_CLIP_STD, device=device).view(1, -1, 1, 1)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """HPSv2's ``preprocess_val`` on the image a pipeline would save: 8-bit levels (PIL ->
        ``ToTensor``), ``Resize(side, BICUBIC)`` of the shortest edge (torchvision on a tensor:
        antialiased, not clamped), ``CenterCrop(side)`` (offsets rounded as torchvision does),
        ``Normalize`` with OpenAI CLIP's mean / std."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"hpsv2 takes RGB images (n,3,H,W), got shape {tuple(images.shape)}")
        x = (images.to(self.device, torch.float32).clamp(0, 1) * 255).round() / 255
        h, w = x.shape[-2:]
        s = self.side
        out = (s, int(s * w / h)) if h <= w else (int(s * h / w), s)
        if out != (h, w):
            x = F.interpolate(x, size=out, mode="bicubic", align_corners=False, antialias=True)
        h, w = x.shape[-2:]
        top, left = int(round((h - s) / 2.0)), int(round((w - s) / 2.0))
        x = x[..., top : top + s, left : left + s]
        return ((x - self.mean) / self.std).to(self.dtype)

    def text_embeds(self, prompts: list[str], batch_size: int) -> torch.Tensor:
        # open_clip's basic_clean (its ftfy pass aside): HTML entities unescaped twice, stripped
        return super().text_embeds([html.unescape(html.unescape(p)).strip() for p in prompts], batch_size)


@register("hpsv2")
class HPSv2(_ClipReward):
    """HPSv2.1 (or v2.0): ``scale * cos(image, prompt)``; scale 1 is the value HPSv2's ``score`` returns
    and DanceGRPO trains on (~0.2-0.35); its benchmark tables print 100x it."""

    def __init__(
        self, path=None, tokenizer=None, arch="ViT-H-14", scale: float = 1.0, batch_size: int = 16,
        device: str = "auto", dtype: str = "float32",
    ):  # fmt: skip
        path, tokenizer = self.check_args(path, tokenizer, arch, scale, batch_size, device, dtype)
        self.backbone = OpenClipBackbone(path, tokenizer, arch, _device(device), DTYPES[dtype])
        self.batch_size, self.scale = batch_size, float(scale)

    @classmethod
    def check_args(
        cls, path=None, tokenizer=None, arch="ViT-H-14", scale: float = 1.0, batch_size: int = 16,
        device: str = "auto", dtype: str = "float32",
    ) -> tuple[Path, Path]:  # fmt: skip
        """What ``__init__`` refuses before loading (the preflight's check): the files, not their
        contents; returns the checkpoint file and the tokenizer directory."""
        batch_size_arg(batch_size)
        if path is None:
            raise RewardArgError("path", "required: the HPS checkpoint file (e.g. HPS_v2.1_compressed.pt)")
        path = Path(path).expanduser()
        if not path.is_file():
            raise RewardArgError("path", f"checkpoint file {path} not found{relative_note(path)}")
        if tokenizer is None:
            raise RewardArgError("tokenizer", "required: a directory with a CLIP tokenizer (any CLIP's)")
        tokenizer = Path(tokenizer).expanduser()
        if not tokenizer.is_dir():
            raise RewardArgError("tokenizer", f"directory {tokenizer} not found{relative_note(tokenizer)}")
        if dtype not in DTYPES:
            raise RewardArgError("dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
        _arch(arch)
        device_name(device)
        return path, tokenizer

    def score(self, images, prompts, metadata):
        return (self.scale * self.cosine(images, prompts)).cpu()
