"""``ocr``: how well an image spells the text its prompt quotes, read by a real pretrained OCR model.

Details: docs/modules.md, `digenrl.rewards.ocr`.
"""

from __future__ import annotations

import numpy as np
import torch

from digenrl.errors import UserError
from digenrl.rewards.base import Reward, RewardArgError, register


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions
    turning ``a`` into ``b`` (Wagner-Fischer, one row at a time)."""
    row = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, ca in enumerate(a, 1):
        prev_diag, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            # delete ca, insert cb, or substitute (free when equal)
            prev_diag, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev_diag + (ca != cb))
    return row[-1]


def ocr_score(reading: str, target: str) -> float:
    """Flow-GRPO's OCR reward of a reading against the target text (both normalised here)."""
    reading = reading.replace(" ", "").lower()
    target = target.replace(" ", "").lower()
    if not target:
        raise ValueError("the OCR target text is empty")
    dist = 0 if target in reading else min(edit_distance(reading, target), len(target))
    return 1.0 - dist / len(target)


def ocr_target(prompt: str, meta: dict) -> str:
    """The text an image should show: metadata ``text`` if given, else what the prompt quotes."""
    if meta.get("text"):
        return str(meta["text"])
    parts = prompt.split('"')
    if len(parts) < 3 or not parts[1].replace(" ", ""):
        raise UserError(
            f"reward ocr: prompt {prompt!r} quotes no text (write the text to render in double quotes, "
            f'e.g. a sign that says "Open", or give it in the prompt\'s metadata as "text")'
        )
    return parts[1]


def _rapidocr():
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as exc:
        raise UserError(
            f"reward 'ocr' needs the optional extra 'ocr': pip install 'digenrl[ocr]' ({exc})"
        ) from None
    return RapidOCR


@register("ocr")
class OcrReward(Reward):
    """Flow-GRPO's OCR accuracy on PP-OCRv4 (rapidocr-onnxruntime), no angle classifier.

    ``args``: ``threads`` (ONNX Runtime threads of each of its sessions, default 1: one core per
    scoring process), ``limit_side_len`` (the detector shrinks an image whose longer side exceeds it;
    smaller images are read at their own size, ``det_limit_type="max"``), ``text_score`` (drop
    recognised lines below this confidence, as PaddleOCR's ``drop_score``).
    """

    def __init__(self, threads: int = 1, limit_side_len: int = 736, text_score: float = 0.5):
        for arg, value in (("threads", threads), ("limit_side_len", limit_side_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RewardArgError(arg, f"must be a positive integer (got {value!r})")
        if not 0 <= text_score < 1:
            raise RewardArgError("text_score", f"must be in [0, 1) (got {text_score!r})")
        self._cls = _rapidocr()  # a missing extra fails here, when the run is built
        self.threads, self.limit_side_len, self.text_score = threads, limit_side_len, text_score
        self._engine = None  # built on first use, in the process that scores (it cannot be pickled)

    def __getstate__(self):
        return {**self.__dict__, "_engine": None, "_cls": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._cls = _rapidocr()

    @property
    def engine(self):
        if self._engine is None:
            n = self.threads
            self._engine = self._cls(
                use_cls=False,
                det_limit_type="max",
                det_limit_side_len=self.limit_side_len,
                text_score=self.text_score,
                intra_op_num_threads=n,
                inter_op_num_threads=n,
            )
        return self._engine

    def read(self, image: torch.Tensor) -> str:
        """All text recognised in one (3,H,W) image in [0,1], its lines joined."""
        rgb = (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round()
        bgr = np.ascontiguousarray(rgb.astype(np.uint8)[..., ::-1])  # the engine takes OpenCV's BGR
        lines, _ = self.engine(bgr)
        return "".join(text for _, text, _ in lines or [])

    def score(self, images, prompts, metadata):
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"ocr takes RGB images (n,3,H,W), got shape {tuple(images.shape)}")
        targets = [ocr_target(p, m) for p, m in zip(prompts, metadata)]
        return torch.tensor([ocr_score(self.read(img), t) for img, t in zip(images, targets)])
