"""``smallworld``: GenEval's rules (digenrl/rewards/geneval.py) on the small world's own detector
instead of a remote one: a local, verifiable, ``geneval``-compatible reward (the same ``args`` but the
service's, the same metadata rows).

Details: docs/smallworld.md.
"""

from __future__ import annotations

import torch

from digenrl.rewards.base import Reward, register
from digenrl.rewards.geneval import Rules, check_meta
from digenrl.rewards.smallworld.detect import detect


@register("smallworld")
class SmallWorldReward(Reward):
    """GenEval correctness (or Flow-GRPO's partial score: ``score: flow_grpo``) of small-world images
    from :func:`~digenrl.rewards.smallworld.detect.detect`; ``last_info`` holds each sample's tag and
    the reasons it failed."""

    def __init__(
        self, threshold=0.3, counting_threshold=0.9, max_objects=16, position_threshold=0.1, score="correct"
    ):
        self.rules = Rules(threshold, counting_threshold, max_objects, position_threshold, score)
        self.last_info: list[dict] | None = None

    def score(self, images, prompts, metadata):
        for p, m in zip(prompts, metadata):
            check_meta(m, p, "smallworld")
        pixels = images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        judged = [self.rules.judge(detect(img), meta) for img, meta in zip(pixels, metadata)]
        self.last_info = [info for _, info in judged]
        return torch.tensor([s for s, _ in judged], dtype=torch.float32)
