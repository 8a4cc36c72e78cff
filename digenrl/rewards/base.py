"""What a reward is: the :class:`Reward` protocol (a video scored per frame unless ``video_native``),
the registry its implementations join with :func:`register`, and the error for a bad ``args`` value."""

from __future__ import annotations

from abc import ABC, abstractmethod
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
