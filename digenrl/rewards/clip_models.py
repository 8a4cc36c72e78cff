"""Model rewards on a CLIP backbone, loaded from a local ``from_pretrained`` directory (never a hub).

Details: docs/modules.md, `digenrl.rewards.clip_models`.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from digenrl.errors import first_line, relative_note
from digenrl.rewards.base import Reward, RewardArgError, register

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_name(name: str) -> torch.device | None:
    """``args.device`` checked for its form only (the preflight's check: the workers' host may have the
    GPU this one lacks); None for ``auto``."""
    if name == "auto":
        return None
    try:
        return torch.device(name)
    except (RuntimeError, TypeError):
        raise RewardArgError(
            "device", f"not a torch device: {name!r} (auto, cpu, cuda, cuda:1, ...)"
        ) from None


def batch_size_arg(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise RewardArgError("batch_size", f"must be a positive integer (got {batch_size!r})")
    return batch_size


def _device(name: str) -> torch.device:
    dev = device_name(name)
    if dev is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RewardArgError("device", f"{name!r} asked for, but CUDA is not available here")
    return dev


class ClipBackbone:
    """A CLIPModel, its tokenizer and its image preprocessing, on one device."""

    def __init__(self, path: Path, processor_path: Path, device: torch.device, dtype: torch.dtype):
        from transformers import AutoTokenizer, CLIPModel

        try:
            self.model = CLIPModel.from_pretrained(path).to(device=device, dtype=dtype).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise RewardArgError("path", f"{path} is not a loadable CLIPModel directory ({exc})") from None
        self.model.requires_grad_(False)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(processor_path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            arg = "path" if processor_path == path else "processor_path"
            raise RewardArgError(arg, f"no CLIP tokenizer in {processor_path} ({exc})") from None
        self.device, self.dtype = device, dtype
        self.max_length = self.model.config.text_config.max_position_embeddings
        self._read_preprocessing(processor_path)

    def _read_preprocessing(self, where: Path) -> None:
        """Resize / crop / normalisation from the processor's own config (CLIPImageProcessor keys)."""
        side = self.model.config.vision_config.image_size
        file = where / "preprocessor_config.json"
        pp = json.loads(file.read_text()) if file.is_file() else {}
        size, crop = pp.get("size", side), pp.get("crop_size", side)
        self.resize = pp.get("do_resize", True)
        if isinstance(size, dict):
            size = size.get("shortest_edge") or (size["height"], size["width"])
        self.size = size  # int: shortest edge; (h, w): exact
        self.crop = (crop, crop) if isinstance(crop, int) else (crop["height"], crop["width"])
        self.do_crop = pp.get("do_center_crop", True)
        self.normalize = pp.get("do_normalize", True)
        self.mean = torch.tensor(pp.get("image_mean", OPENAI_CLIP_MEAN), device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(pp.get("image_std", OPENAI_CLIP_STD), device=self.device).view(1, -1, 1, 1)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """(n,3,H,W) in [0,1] -> CLIP pixel_values on the model's device and dtype."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"CLIP rewards take RGB images (n,3,H,W), got shape {tuple(images.shape)}")
        x = images.to(self.device, torch.float32)
        if self.resize:
            h, w = x.shape[-2:]
            if isinstance(self.size, int):  # shortest edge -> size, keep the aspect ratio
                out = (self.size, int(self.size * w / h)) if h <= w else (int(self.size * h / w), self.size)
            else:
                out = tuple(self.size)
            if out != (h, w):
                x = F.interpolate(x, size=out, mode="bicubic", align_corners=False, antialias=True).clamp(
                    0, 1
                )
        if self.do_crop:
            h, w = x.shape[-2:]
            ch, cw = self.crop
            if h < ch or w < cw:  # as the processor does: pad a too-small image with zeros
                ph, pw = max(ch - h, 0), max(cw - w, 0)
                x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2))
                h, w = x.shape[-2:]
            top, left = (h - ch) // 2, (w - cw) // 2
            x = x[..., top : top + ch, left : left + cw]
        if self.normalize:
            x = (x - self.mean) / self.std
        return x.to(self.dtype)

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor, batch_size: int) -> torch.Tensor:
        """L2-normalised projected image embeddings (n, projection_dim), fp32."""
        out = []
        for chunk in images.split(batch_size):
            pooled = self.model.vision_model(pixel_values=self.preprocess(chunk)).pooler_output
            out.append(F.normalize(self.model.visual_projection(pooled).float(), dim=-1))
        return torch.cat(out)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str], batch_size: int) -> torch.Tensor:
        """L2-normalised projected text embeddings, one per prompt (each distinct prompt encoded once)."""
        unique = list(dict.fromkeys(prompts))
        out = []
        for i in range(0, len(unique), batch_size):
            tok = self.tokenizer(
                unique[i : i + batch_size],
                padding="max_length",
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            pooled = self.model.text_model(
                input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]
            ).pooler_output
            out.append(F.normalize(self.model.text_projection(pooled).float(), dim=-1))
        row = {p: i for i, p in enumerate(unique)}
        return torch.cat(out)[[row[p] for p in prompts]]


_LOADED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def load_backbone(path, processor_path=None, device: str = "auto", dtype: str = "float32") -> ClipBackbone:
    """Checks the arguments (errors name the arg) and loads, or reuses, the backbone."""
    path, proc = backbone_args(path, processor_path, dtype)
    dev = _device(device)
    key = (str(path.resolve()), str(proc.resolve()), str(dev), dtype)
    backbone = _LOADED.get(key)
    if backbone is None:
        backbone = _LOADED[key] = ClipBackbone(path, proc, dev, DTYPES[dtype])
    return backbone


def backbone_args(path, processor_path, dtype: str) -> tuple[Path, Path]:
    """The backbone's directories and dtype checked without loading (errors name the arg)."""
    if path is None:
        raise RewardArgError(
            "path", "required: a local directory with the CLIP weights (from_pretrained layout)"
        )
    path = Path(path).expanduser()
    if not path.is_dir():
        raise RewardArgError("path", f"weights directory {path} not found{relative_note(path)}")
    if not (path / "config.json").is_file():
        raise RewardArgError(
            "path", f"{path} has no config.json (expected a transformers CLIPModel directory)"
        )
    proc = Path(processor_path).expanduser() if processor_path is not None else path
    if not proc.is_dir():
        raise RewardArgError("processor_path", f"directory {proc} not found{relative_note(proc)}")
    if dtype not in DTYPES:
        raise RewardArgError("dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    return path, proc


class _ClipReward(Reward):
    """Shared loading and batching; subclasses turn embeddings into scores. (Videos: every reward's
    ``args.frame_stride`` is read by the reward builder, which sets :attr:`Reward.frame_stride`.)"""

    loads_model = True

    def __init__(
        self,
        path=None,
        processor_path=None,
        batch_size: int = 16,
        device: str = "auto",
        dtype: str = "float32",
    ):
        self.batch_size = batch_size_arg(batch_size)
        self.backbone = load_backbone(path, processor_path, device, dtype)

    @classmethod
    def check_args(cls, path=None, processor_path=None, batch_size=16, device="auto", dtype="float32"):
        """What ``__init__`` refuses, checked without loading (the preflight's check), in its order."""
        batch_size_arg(batch_size)
        backbone_args(path, processor_path, dtype)
        device_name(device)

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    def cosine(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        img = self.backbone.image_embeds(images, self.batch_size)
        txt = self.backbone.text_embeds(prompts, self.batch_size)
        return (img * txt).sum(dim=-1)


@register("clipscore")
class ClipScore(_ClipReward):
    """CLIPScore: ``w * max(cos, 0)`` with w = 2.5 (Hessel et al. 2021); in [0, w]."""

    def __init__(self, w: float = 2.5, **kwargs):
        super().__init__(**kwargs)
        self.w = float(w)

    @classmethod
    def check_args(cls, w: float = 2.5, **kwargs):
        super().check_args(**kwargs)

    def score(self, images, prompts, metadata):
        return (self.w * self.cosine(images, prompts).clamp(min=0)).cpu()


@register("pickscore")
class PickScore(_ClipReward):
    """PickScore: the fine-tuned CLIP's ``logit_scale.exp()`` times the image-prompt cosine
    (Flow-GRPO trains on it divided by 26: set the component's weight accordingly)."""

    def score(self, images, prompts, metadata):
        scale = self.backbone.model.logit_scale.detach().float().exp()
        return (scale * self.cosine(images, prompts)).cpu()


LAION_HIDDEN = (
    1024,
    128,
    64,
    16,
)  # the LAION improved aesthetic predictor's MLP, on ViT-L/14's 768-d embedding
LAION_DROPOUT = (0.2, 0.2, 0.1, 0.0)


class AestheticHead(nn.Module):
    """in_dim -> 1024 -> 128 -> 64 -> 16 -> 1, purely linear (with dropout between, as trained).
    Layer indices 0, 2, 4, 6, 7 match the published ``layers.N.weight`` state-dict keys."""

    def __init__(self, in_dim: int):
        super().__init__()
        layers: list[nn.Module] = []
        dims = (in_dim, *LAION_HIDDEN)
        for i, p in enumerate(LAION_DROPOUT):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if p:
                layers.append(nn.Dropout(p))
        layers.append(nn.Linear(LAION_HIDDEN[-1], 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_head_state(head) -> dict[str, torch.Tensor]:
    if head is None:
        raise RewardArgError("head", "required: the MLP head's weights (.safetensors, .pt or .pth)")
    head = Path(head).expanduser()
    if not head.is_file():
        raise RewardArgError("head", f"head weights file {head} not found{relative_note(head)}")
    state = read_state_dict(head, "head")
    return {k if k.startswith("layers.") else f"layers.{k}": v for k, v in state.items()}


def read_state_dict(path: Path, field: str) -> dict[str, torch.Tensor]:
    """The tensors of a weights file (.safetensors, or torch's .pt / .pth / .bin; a ``{"state_dict":
    ...}`` wrapper unwrapped); an unreadable file is a one-line error naming the reward's ``field``."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt / not a weights file
        raise RewardArgError(field, f"cannot read {path} ({first_line(exc, typed=True)})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RewardArgError(field, f"{path} does not hold a state dict of tensors")
    return state


@register("aesthetic")
class Aesthetic(_ClipReward):
    """LAION-style aesthetic predictor: the MLP ``head`` (a local file) on the L2-normalised CLIP
    image embedding; its input size is the CLIP projection size (768 for ViT-L/14)."""

    @classmethod
    def check_args(cls, head=None, **kwargs):
        load_head_state(head)
        super().check_args(**kwargs)

    def __init__(self, head=None, **kwargs):
        state = load_head_state(head)
        super().__init__(**kwargs)
        in_dim = self.backbone.model.config.projection_dim
        self.head = AestheticHead(in_dim)
        try:
            self.head.load_state_dict(state)
        except RuntimeError as exc:
            first = state.get("layers.0.weight")
            got = (
                f" (its first layer takes {first.shape[-1]} features)"
                if first is not None and first.ndim == 2
                else ""
            )
            mlp = "->".join(map(str, (in_dim, *LAION_HIDDEN, 1)))
            raise RewardArgError(
                "head",
                f"{head} does not fit the MLP {mlp} on this CLIP's {in_dim}-d "
                f"embedding{got}: {str(exc).splitlines()[0]}",
            ) from None
        self.head.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, images, prompts, metadata):
        emb = self.backbone.image_embeds(images, self.batch_size)
        return self.head(emb).squeeze(-1).float().cpu()
