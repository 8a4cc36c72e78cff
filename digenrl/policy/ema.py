"""An exponential moving average (EMA) of the trained weights, for eval and export (``train.ema``).

Details: docs/modules.md, `digenrl.policy.ema`.
"""

from __future__ import annotations

import contextlib

import torch

from digenrl.algorithms.nft import load_like
from digenrl.policy.lora import full_tensor


def ema_decay(cfg, n: int) -> float:
    """The decay applied at the n-th optimizer step (1-based)."""
    return min(cfg.decay, (1 + n) / (10 + n)) if cfg.warmup else cfg.decay


class WeightAverage:
    """fp32 EMA of named parameters (``params``: name -> the trained tensor)."""

    def __init__(self, params: dict[str, torch.Tensor], cfg):
        self.cfg, self.params = cfg, params
        self.average = {n: p.detach().float().clone() for n, p in params.items()}
        self.steps = 0  # optimizer steps seen (n)

    @torch.no_grad()
    def update(self) -> None:
        """Called after every optimizer step; averages every ``cfg.every``-th."""
        self.steps += 1
        if self.steps % self.cfg.every:
            return
        weight = 1.0 - ema_decay(self.cfg, self.steps)
        for name, p in self.params.items():
            avg = self.average[name]
            avg.add_(p.detach().float() - avg, alpha=weight)

    def state(self) -> dict[str, torch.Tensor]:
        """The average as CPU fp32 tensors (what a checkpoint stores); gathered from the shards
        when it is sharded like its FSDP2 parameters (a collective: every rank calls it)."""
        return {n: full_tensor(t).detach().cpu().clone() for n, t in self.average.items()}

    def load(self, state: dict[str, torch.Tensor], steps: int) -> None:
        if set(state) != set(self.average):
            missing = sorted(set(self.average) - set(state))[:3]
            raise ValueError(f"EMA keys do not match the trained parameters (missing {missing})")
        for n, t in state.items():
            self.average[n] = load_like(self.average[n], t)
        self.steps = steps

    def reset(self) -> None:
        """Restart from the current weights (a resume from a checkpoint that holds no average)."""
        self.average = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.steps = 0


@contextlib.contextmanager
def swapped_in(params: dict[str, torch.Tensor], values: dict[str, torch.Tensor]):
    """``params`` hold ``values`` (cast to their dtype) inside the block, their own values after it."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(values[n].to(p.device, p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])
