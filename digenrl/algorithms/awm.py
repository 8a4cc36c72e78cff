"""AWM, Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050; Flow-Factory's ``awm``).

Details: docs/modules.md, `digenrl.algorithms.awm`.
"""

from __future__ import annotations

import torch

#: the generalised Huber weighting's floor (keeps (l + floor)^p differentiable at l = 0)
GHUBER_FLOOR = 1e-10


def matching_error(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Per sample: l = mean((v - (eps - x0))^2), the flow-matching error against the target eps - x0."""
    return _mean((v - (eps - x0)) ** 2)


def weighted_error(err: torch.Tensor, t: torch.Tensor, weighting: str, power: float = 0.25) -> torch.Tensor:
    """w(t, l) per sample: ``uniform`` l; ``t`` t l; ``t2`` t^2 l; ``ghuber`` t / p ((l + c)^p - c^p)
    (a generalised Huber loss: large errors count less, c = 1e-10)."""
    t = t.to(err.dtype)
    if weighting == "uniform":
        return err
    if weighting == "t":
        return t * err
    if weighting == "t2":
        return t**2 * err
    if weighting == "ghuber":
        return t / power * ((err + GHUBER_FLOOR) ** power - GHUBER_FLOOR**power)
    raise ValueError(f"unknown AWM weighting {weighting!r}")


def awm_loss(
    v: torch.Tensor,
    x0: torch.Tensor,
    eps: torch.Tensor,
    t: torch.Tensor,
    adv: torch.Tensor,
    weighting: str = "uniform",
    power: float = 0.25,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sample loss A * w(t, l), the detached matching error l)."""
    err = matching_error(v, x0, eps)
    return adv.to(err.dtype) * weighted_error(err, t, weighting, power), err.detach()


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)
