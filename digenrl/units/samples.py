"""What a rollout unit hands on (``Samples``) and the per-group noise stream it draws from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from digenrl.adapters.cond import Cond
from digenrl.rewards.base import Scores


class GroupRNG:
    """One torch.Generator per prompt group; draws the batch's noise as a concatenation of groups.

    ``samples``: the samples [lo, hi) of each group the batch holds (a sub-group unit); every draw
    still takes all ``group_size`` samples' noise from the group's stream, so sample i gets the same
    noise whichever part of the group it is generated in."""

    def __init__(self, seeds: list[int], group_size: int, samples: tuple[int, int] | None = None):
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.g = group_size
        self.lo, self.hi = samples or (0, group_size)

    def __call__(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.cat(
            [torch.randn((self.g, *shape[1:]), generator=gen)[self.lo : self.hi] for gen in self.gens]
        )


@dataclass
class Samples:
    """A rollout unit's output; CPU tensors so it can travel between processes."""

    iteration: int
    version: int  # policy version that generated every sample
    group_ids: list[int]
    prompts: list[str]  # one per sample (each prompt repeated G times)
    cond: Cond
    latents: torch.Tensor  # (B, N+1, ...) fp32; diffusion_nft: (B, 1, ...), the clean sample only
    log_probs: torch.Tensor  # (B, N) behaviour log-probs; diffusion_nft: (B, 0)
    sigmas: torch.Tensor
    sde_mask: torch.Tensor  # (N,)
    train_idx: torch.Tensor  # (B, T) steps to train; diffusion_nft: (B, K) noise levels (sigma indices)
    rewards: torch.Tensor | None = None  # (B,) weighted total, once scored (:meth:`take`)
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)
    advantages: torch.Tensor | None = None  # (B,) or per step (B, N), set once the group's rewards are known
    preview: torch.Tensor | None = None  # uint8 pixels of the first sample of each group
    timings: dict[str, float] = field(default_factory=dict)  # ref_forwards: the unit's KL reference forwards
    first_sample: int = 0  # a sub-group unit: the in-group index of its groups' first sample
    noise_seeds: torch.Tensor | None = None  # diffusion_nft: (B, K) seeds of each level's forward noise
    step_noise: torch.Tensor | None = None  # (B, N, ...) x_{i+1} - mu_behaviour_i (stale samples' gradient)
    # (B, T, ...) the KL reference's step mean at each trained-step position (algorithm.kl_reference
    # rollout; None: the trainer runs the reference forward)
    ref_means: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, scores: Scores) -> Samples:
        """These samples with their rewards (:func:`~digenrl.rewards.base.score`'s result)."""
        self.rewards, self.reward_parts = scores.total, scores.parts
        return self


#: the tensor fields of :class:`Samples` that hold one row per sample (None where a run has none):
#: what cutting a unit's rows or joining its shares touches, beside ``prompts``, ``cond`` and
#: ``reward_parts``. A per-sample field added to Samples belongs here, or a split unit loses it.
ROW_FIELDS = (
    "latents",
    "log_probs",
    "train_idx",
    "rewards",
    "advantages",
    "noise_seeds",
    "step_noise",
    "ref_means",
)
