"""Prompt conditioning as it travels from the text encoders to the transformer (and from rollout
to training)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Cond:
    """Prompt conditioning, batch-first; travels with the samples from rollout to training.

    ``batched`` tensors have the batch on dim 0; ``shared`` ones (e.g. FLUX ``txt_ids``) do not.
    """

    batched: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return next(iter(self.batched.values())).shape[0]

    def select(self, idx) -> Cond:
        return Cond({k: v[idx] for k, v in self.batched.items()}, self.shared)

    def repeat_interleave(self, n: int) -> Cond:
        return Cond({k: v.repeat_interleave(n, dim=0) for k, v in self.batched.items()}, self.shared)

    def to(self, device) -> Cond:
        return Cond(
            {k: v.to(device) for k, v in self.batched.items()},
            {k: v.to(device) for k, v in self.shared.items()},
        )

    @staticmethod
    def cat(conds: list[Cond]) -> Cond:
        keys = conds[0].batched.keys()
        return Cond({k: torch.cat([c.batched[k] for c in conds]) for k in keys}, conds[0].shared)
