"""Rewards: a registry of scorers and their weighted combination.

A reward is a callable ``(pixels, prompts, metadata) -> (N,) float tensor``; ``pixels`` are in [0,1],
images (N,C,H,W) or videos (N,C,F,H,W). Image rewards score videos per frame (averaged) unless
they declare ``video_native = True``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from digenrl.config import RewardConfig
from digenrl.errors import UserError

REWARDS: dict[str, Callable[..., "Reward"]] = {}


def register(name: str):
    def deco(cls):
        REWARDS[name] = cls
        cls.name = name
        return cls

    return deco


class Reward(ABC):
    name = ""
    video_native = False

    @abstractmethod
    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(N,) scores for images (N,C,H,W) (or videos when ``video_native``)."""

    def __call__(self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        metadata = metadata or [{} for _ in prompts]
        if pixels.ndim == 5 and not self.video_native:  # video: score every frame, average per video
            n, c, f, h, w = pixels.shape
            frames = pixels.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w)
            rep = lambda xs: [x for x in xs for _ in range(f)]  # noqa: E731
            return self.score(frames, rep(prompts), rep(metadata)).view(n, f).mean(dim=1)
        return self.score(pixels, prompts, metadata)


class CombinedReward:
    """Weighted sum of the configured components; also returns each component for logging."""

    def __init__(self, cfg: RewardConfig):
        self.terms = []
        for term in cfg.components:
            if term.name not in REWARDS:
                raise UserError(f"reward.components: unknown reward '{term.name}' (available: {', '.join(sorted(REWARDS))})")
            try:
                self.terms.append((term.name, term.weight, REWARDS[term.name](**term.args)))
            except TypeError as exc:
                raise UserError(f"reward.components.{term.name}.args: {exc}") from None
        self.nan_policy = cfg.nan_policy

    def __call__(self, pixels, prompts, metadata=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        parts = {}
        for name, _, fn in self.terms:
            r = fn(pixels, prompts, metadata).float().cpu()
            if r.shape != (len(prompts),):
                raise UserError(f"reward '{name}' returned shape {tuple(r.shape)}, expected ({len(prompts)},)")
            if torch.isnan(r).any() and self.nan_policy == "fail":
                raise UserError(f"reward '{name}' returned NaN for {int(torch.isnan(r).sum())} samples "
                                "(set reward.nan_policy=drop to skip them)")
            parts[name] = r
        total = sum(w * parts[name] for name, w, _ in self.terms)
        return total, parts


def build_reward(cfg: RewardConfig) -> CombinedReward:
    from digenrl.rewards import basic  # noqa: F401  (registers the weight-free rewards)

    return CombinedReward(cfg)


