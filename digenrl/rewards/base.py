"""What a reward is: the :class:`Reward` protocol (a video scored per frame unless ``video_native``),
the registry its implementations join with :func:`register`, the error for a bad ``args`` value, and
what every scoring mode shares: the :class:`Decoded` samples a reward scores, :func:`score`, its
:class:`Scores`."""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from digenrl.errors import UserError

REWARDS: dict[str, Callable[..., "Reward"]] = {}


def register(name: str):
    def deco(cls):
        REWARDS[name] = cls
        cls.name = name
        return cls

    return deco


class RewardArgError(UserError):
    """A bad value for one of a reward's ``args``; :class:`CombinedReward` prefixes the config path."""

    def __init__(self, arg: str, message: str):
        super().__init__(f"args.{arg}: {message}")
        self.arg, self.message = arg, message


class Reward(ABC):
    name = ""
    video_native = False
    frame_stride = 1  # videos: score frames 0, s, 2s, ... and average
    #: a model (CLIP, HPS): the preflight calls ``check_args(**args)`` (what ``__init__`` refuses before
    #: loading, in its order) instead of loading it
    loads_model = False

    @abstractmethod
    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(N,) scores for images (N,C,H,W) (or videos when ``video_native``)."""

    def __call__(
        self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None
    ) -> torch.Tensor:
        metadata = metadata or [{} for _ in prompts]
        if pixels.ndim == 5 and not self.video_native:  # video: score sampled frames, average per video
            pixels = pixels[:, :, :: self.frame_stride]
            n, c, f, h, w = pixels.shape
            frames = pixels.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w)
            return self.score(frames, _per_frame(prompts, f), _per_frame(metadata, f)).view(n, f).mean(dim=1)
        return self.score(pixels, prompts, metadata)


def _per_frame(items: list, frames: int) -> list:
    """Each item repeated once per scored frame (a video's prompt for each of its frames)."""
    return [x for x in items for _ in range(frames)]


@dataclass
class Decoded:
    """What a reward scores: a unit's decoded samples (pixels in [0, 1], CPU, NCHW or NCFHW) with one
    prompt and one metadata row per sample. Rollout units hand it on; every scoring mode scores it with
    :func:`score` (inline, after the unit on a rollout worker, in the reward service)."""

    pixels: torch.Tensor
    prompts: list[str]
    metadata: list[dict]

    @staticmethod
    def cat(parts: list["Decoded"], rows: torch.Tensor | None = None) -> "Decoded":
        """The parts joined (then ``rows`` of them, in that order)."""
        pixels = torch.cat([d.pixels for d in parts])
        prompts, metadata = sum((d.prompts for d in parts), []), sum((d.metadata for d in parts), [])
        if rows is None:
            return Decoded(pixels, prompts, metadata)
        order = rows.tolist()
        return Decoded(pixels[rows], [prompts[i] for i in order], [metadata[i] for i in order])


@dataclass
class Scores:
    """One scoring call's result and how it went, measured where it ran: ``start`` / ``end``
    (``time.time()`` of the scoring itself), ``timings`` (seconds per reward), and from the reward
    service ``wait_s`` (queued behind other calls), ``queue_depth`` (calls ahead) and ``pid``."""

    total: torch.Tensor
    parts: dict[str, torch.Tensor]
    start: float
    end: float
    timings: dict[str, float] = field(default_factory=dict)
    wait_s: float = 0.0
    queue_depth: int = 0
    pid: int = 0  # the scoring process: a new one means Ray restarted it


def score(reward_fn, decoded: Decoded) -> Scores:
    """Score ``decoded`` with ``reward_fn`` (``(pixels, prompts, metadata) -> (total, parts)``, e.g. a
    :class:`~digenrl.rewards.CombinedReward`), timed: the one scoring call of every mode."""
    start = time.time()
    with torch.no_grad():  # (grad mode is per thread: a side call's thread has its own)
        total, parts = reward_fn(decoded.pixels, decoded.prompts, decoded.metadata)
    end = time.time()
    return Scores(total, parts, start, end, dict(getattr(reward_fn, "last_timings", {})), pid=os.getpid())
