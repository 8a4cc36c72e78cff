"""``remote``: a reward scored by an HTTP server (GenEval, OCR, UnifiedReward, VideoAlign in their own
environments). Standard library only (urllib, json, base64); docs/remote_reward.md has the payload and
benchmarks/reward_server.py a server to copy.

Details: docs/modules.md, `digenrl.rewards.remote`.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import torch

from digenrl.errors import UserError
from digenrl.rewards.base import Reward, RewardArgError, register


class RemoteRewardError(UserError):
    """The reward server is unreachable or its answer is unusable: the run cannot go on."""

    exit_code = 1


class _Retryable(Exception):
    """A failure worth another try: no connection, a timeout, HTTP 5xx."""


def encode_png(pixels: torch.Tensor) -> str:
    """(C, H, W) in [0, 1] -> base64 of an 8-bit PNG (RGB, or L for one channel)."""
    from PIL import Image

    arr = (pixels.detach().float().clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)
    img = Image.fromarray(arr[0] if arr.shape[0] == 1 else arr.transpose(1, 2, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_images(images: torch.Tensor, fmt: str) -> object:
    """A batch (n, C, H, W) or (n, C, F, H, W) as the payload's ``images`` field."""
    if fmt == "array":
        arr = np.ascontiguousarray(images.detach().float().cpu().numpy(), dtype="<f4")
        return {
            "shape": list(arr.shape),
            "dtype": "float32",
            "data": base64.b64encode(arr.tobytes()).decode("ascii"),
        }
    if images.ndim == 5:  # a video per sample: its frames as PNGs
        return [[encode_png(frame) for frame in video.unbind(1)] for video in images]
    return [encode_png(img) for img in images]


def _positive(name: str, value, kind=float, allow_zero: bool = False):
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok or (kind is int and int(value) != value):
        what = "a non-negative" if allow_zero else "a positive"
        raise RewardArgError(name, f"must be {what} {'integer' if kind is int else 'number'} (got {value!r})")
    return kind(value)


@register("remote")
class RemoteReward(Reward):
    """Scores from an HTTP server: ``args: {url, timeout, retries, backoff, batch_size, format,
    video_native}``."""

    def __init__(
        self,
        url: str | None = None,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 1.0,
        batch_size: int = 64,
        format: str = "png",
        video_native: bool = False,
    ):  # noqa: A002
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RewardArgError(
                "url", f"an http:// or https:// address of the reward server is required (got {url!r})"
            )
        if format not in ("png", "array"):
            raise RewardArgError("format", f"must be png or array (got {format!r})")
        self.url, self.format = url, format
        self.timeout = _positive("timeout", timeout)
        self.retries = _positive("retries", retries, int, allow_zero=True)
        self.backoff = _positive("backoff", backoff, allow_zero=True)
        self.batch_size = _positive("batch_size", batch_size, int)
        self.video_native = bool(video_native)
        self.last_info: list[dict] | None = None
        self.calls = 0  # HTTP requests that got an answer

    def score(self, images, prompts, metadata):
        scores, infos = [], []
        for lo in range(0, len(prompts), self.batch_size):
            hi = lo + self.batch_size
            got, info = self._score_batch(images[lo:hi], prompts[lo:hi], metadata[lo:hi])
            scores += got
            infos += info
        self.last_info = infos
        return torch.tensor(scores, dtype=torch.float32)

    def _score_batch(self, images, prompts, metadata) -> tuple[list[float], list[dict]]:
        payload = {
            "format": self.format,
            "prompts": list(prompts),
            "metadata": [dict(m) for m in metadata],
            "images": encode_images(images, self.format),
        }
        body = json.dumps(payload, default=str).encode()
        return self._parse(self._post_with_retries(body), len(prompts))

    def _post_with_retries(self, body: bytes) -> bytes:
        for attempt in range(self.retries + 1):
            try:
                return self._post(body)
            except _Retryable as exc:
                if attempt == self.retries:
                    tries = f"{self.retries + 1} tries" if self.retries else "1 try"
                    raise self._error(f"{exc} (after {tries})") from None
                time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")

    def _post(self, body: bytes) -> bytes:
        headers = {"Content-Type": "application/json", **getattr(self, "headers", {})}
        req = urllib.request.Request(self.url, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode(errors="replace").strip().replace("\n", " ")
            msg = f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
            if exc.code >= 500:
                raise _Retryable(msg) from None
            raise self._error(msg) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise _Retryable(f"no answer within {self.timeout:g} s") from None
            raise _Retryable(f"no server answers ({getattr(reason, 'strerror', None) or reason})") from None
        except (TimeoutError, socket.timeout):
            raise _Retryable(f"no answer within {self.timeout:g} s") from None
        except (ConnectionError, http.client.HTTPException) as exc:  # closed mid-answer
            raise _Retryable(f"the connection broke ({type(exc).__name__}: {exc})") from None
        self.calls += 1
        return data

    def _parse(self, data: bytes, n: int) -> tuple[list[float], list[dict]]:
        try:
            answer = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            head = data[:60].decode(errors="replace").replace("\n", " ")
            raise self._error(f"the answer is not JSON (starts {head!r})") from None
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise self._error(
                'the answer has no "scores" list (expected {"scores": [one number per sample]})'
            )
        if len(scores) != n:
            raise self._error(f"answered {len(scores)} scores for {n} samples")
        bad = next(
            (i for i, s in enumerate(scores) if isinstance(s, bool) or not isinstance(s, (int, float))), None
        )
        if bad is not None:
            raise self._error(f"score {bad} is not a number ({scores[bad]!r})")
        info = answer.get("info")
        if info is None:
            info = [{} for _ in range(n)]
        elif not (isinstance(info, list) and len(info) == n and all(isinstance(x, dict) for x in info)):
            raise self._error(f'"info" must be a list of {n} objects, one per sample')
        return [float(s) for s in scores], info

    def _error(self, what: str) -> RemoteRewardError:
        return RemoteRewardError(f"reward '{self.name}' at {self.url}: {what}")  # (a subclass: its name)
