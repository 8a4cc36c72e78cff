"""Kernel efficiency (MFU) as a function of the tokens one forward processes.

Details: docs/modules.md, `digenrl.planner.efficiency`.
"""

from __future__ import annotations

from dataclasses import dataclass

from digenrl.planner.gpus import kernel_efficiency

#: tokens per forward at which a call reaches half its peak efficiency: an assumed default (a GEMM of
#: ~1k rows x the model width fills about half an H100's tiles); a profile at several batches replaces it
DEFAULT_HALF_TOKENS = 1024.0


def tokens_factor(tokens: float, half: float) -> float:
    """Share of the peak efficiency a call of ``tokens`` tokens reaches: ``tokens / (tokens + half)``."""
    if half <= 0:
        return 1.0
    return tokens / (tokens + half) if tokens > 0 else 1.0


@dataclass(frozen=True)
class KernelEfficiency:
    """Peak efficiencies (share of peak bf16 FLOP/s) of a sampling forward and a training forward +
    backward on one device type, the half-saturation token counts, and where they come from."""

    rollout: float
    train: float
    half_tokens_rollout: float = DEFAULT_HALF_TOKENS
    half_tokens_train: float = DEFAULT_HALF_TOKENS
    source: str = "default"

    def rollout_at(self, tokens: float) -> float:
        return self.rollout * tokens_factor(tokens, self.half_tokens_rollout)

    def train_at(self, tokens: float) -> float:
        return self.train * tokens_factor(tokens, self.half_tokens_train)


def device_efficiency(params, device: str) -> KernelEfficiency:
    """The efficiencies the cost model uses on ``device``: the configured / profile-calibrated ones of
    ``params`` (a :class:`~digenrl.planner.params.CostParams`) where set, else the device table's."""

    table_rollout, table_train, table_source = kernel_efficiency(device)
    if params.device_mfu and device in params.device_mfu:  # another fit of the device table's pair
        table_rollout, table_train = params.device_mfu[device]
    explicit = params.mfu_rollout is not None or params.mfu_train is not None
    return KernelEfficiency(
        rollout=params.mfu_rollout if params.mfu_rollout is not None else table_rollout,
        train=params.mfu_train if params.mfu_train is not None else table_train,
        half_tokens_rollout=params.mfu_half_tokens_rollout,
        half_tokens_train=params.mfu_half_tokens_train,
        source=params.mfu_source if explicit else table_source,
    )


def fit_curve(points: dict[float, float], cap: float) -> tuple[float, float]:
    """(peak, half) of ``mfu(n) = peak n / (n + half)`` through measured ``{tokens: mfu}`` points:
    ``1 / mfu = 1 / peak + (half / peak) / n`` is a line in ``1 / n``, fitted by least squares. With
    one point, or points the curve cannot describe (efficiency falling with size), the default
    ``half`` and the median peak those points imply."""
    xs = sorted(points)
    if len(xs) >= 2:
        u = [1.0 / n for n in xs]
        v = [1.0 / points[n] for n in xs]
        mu, mv = sum(u) / len(u), sum(v) / len(v)
        suu = sum((a - mu) ** 2 for a in u)
        slope = sum((a - mu) * (b - mv) for a, b in zip(u, v)) / suu if suu > 0 else -1.0
        intercept = mv - slope * mu
        if slope >= 0 and intercept > 0:
            return min(cap, 1.0 / intercept), slope / intercept
    implied = sorted(points[n] / tokens_factor(n, DEFAULT_HALF_TOKENS) for n in xs)
    return min(cap, implied[len(implied) // 2]), DEFAULT_HALF_TOKENS
