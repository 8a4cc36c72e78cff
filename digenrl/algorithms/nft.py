"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): online RL on the forward process.

Details: docs/modules.md, `digenrl.algorithms.nft`.
"""

from __future__ import annotations

import torch

#: the adaptive weight's floor (the reference code's ``clip(min=0.00001)``)
WEIGHT_FLOOR = 1e-5


def optimality(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """r = clip(0.5 + A / (2 adv_clip), 0, 1): the group advantage A (already clipped to +-adv_clip)
    mapped to an optimality probability. A flat group (A = 0) gives r = 1/2: v+ and v- pull equally
    and, at v = v_old, the gradient is zero."""
    return (advantages.clamp(-adv_clip, adv_clip) / adv_clip / 2.0 + 0.5).clamp(0.0, 1.0)


def forward_noise(x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, t (B,) broadcast over each sample (the flow-matching forward process)."""
    t = _per_sample(t, x0)
    return (1 - t) * x0 + t * eps


def implicit_velocities(
    v: torch.Tensor, v_old: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(v+, v-) = ((1 - beta) v_old + beta v, (1 + beta) v_old - beta v); v_old carries no gradient."""
    v_old = v_old.detach()
    return (1 - beta) * v_old + beta * v, (1 + beta) * v_old - beta * v


def adaptive_x0_error(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per sample: mean((x0_pred - x0)^2) / w with w = max(mean|x0_pred - x0|, 1e-5), w detached and
    computed in float64 (the paper's adaptive weighting: each sample's error on a comparable scale)."""
    diff = x0_pred - x0
    with torch.no_grad():
        w = _mean(diff.double().abs()).clamp(min=WEIGHT_FLOOR).to(diff.dtype)
    return _mean(diff**2) / w


def nft_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    adv_clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-sample DiffusionNFT loss (B,) and its detached parts (positive / negative error, and
    the deviation mean((v - v_old)^2) of the current policy from the old one)."""
    v_pos, v_neg = implicit_velocities(v, v_old, beta)
    t = _per_sample(t, x_t)
    pos = adaptive_x0_error(x_t - t * v_pos, x0)  # x0 predicted by the positive policy
    neg = adaptive_x0_error(x_t - t * v_neg, x0)  # ... and by the negative one
    loss = adv_clip * (r * pos + (1 - r) * neg) / beta
    with torch.no_grad():
        parts = {"positive": pos.detach(), "negative": neg.detach(), "old_deviation": _mean((v - v_old) ** 2)}
    return loss, parts


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """The reference code's KL surrogate: mean((v - v_ref)^2) per sample (velocity space)."""
    return _mean((v - v_ref.detach()) ** 2)


def old_decay(step: int, flat: int, rate: float, cap: float) -> float:
    """The old policy's EMA decay after ``step`` optimizer steps: 0 for the first ``flat`` steps, then
    rising by ``rate`` per step up to ``cap`` (the reference's ``return_decay``; its type 1 is
    (0, 0.001, 0.5), type 2 (75, 0.0075, 0.999))."""
    if step < flat:
        return 0.0
    return min((step - flat) * rate, cap)


class OldPolicy:
    """The old policy v_old: an fp32 EMA of the trained parameters (``params``: name -> tensor; LoRA
    tensors, or every weight in a full fine-tune), blended once per iteration, after its last
    optimizer step: ``old <- d old + (1 - d) w`` with d = :func:`old_decay` of the optimizer steps so
    far. On FSDP trainer ranks the average is sharded like its parameters (elementwise, so equal)."""

    def __init__(self, params: dict[str, torch.Tensor], cfg):
        self.cfg, self.params = cfg, params
        self.average = {n: p.detach().float().clone() for n, p in params.items()}
        self.steps = 0  # optimizer steps seen

    @torch.no_grad()
    def step(self, publish: bool) -> None:
        """After every optimizer step; ``publish`` (the iteration's last step) blends the average."""
        self.steps += 1
        if not publish:
            return
        d = old_decay(self.steps, self.cfg.decay_flat, self.cfg.decay_rate, self.cfg.decay_max)
        for name, p in self.params.items():
            avg = self.average[name]
            avg.mul_(d).add_(p.detach().float(), alpha=1.0 - d)

    def state(self) -> dict[str, torch.Tensor]:
        """The old policy as CPU fp32 tensors (what a checkpoint stores), gathered from FSDP shards
        (a collective: every rank calls it)."""
        whole = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in self.average.values())
        return {n: t.detach().cpu().clone() for n, t in zip(self.average, whole)}

    def load(self, state: dict[str, torch.Tensor], steps: int) -> None:
        if set(state) != set(self.average):
            missing = sorted(set(self.average) - set(state))[:3]
            raise ValueError(f"old-policy keys do not match the trained parameters (missing {missing})")
        for n, t in state.items():
            self.average[n] = load_like(self.average[n], t)
        self.steps = steps

    def reset(self, steps: int = 0) -> None:
        """Restart from the current weights (a resumed run: the checkpoint holds no old policy)."""
        self.average = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.steps = steps


def load_like(average: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The whole tensor ``full`` (a checkpoint's, on the host) as fp32 laid out like ``average``: its
    shard when ``average`` is sharded (a DTensor), a copy into it otherwise."""
    if hasattr(average, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = full.detach().float().to(average.device)
        return distribute_tensor(value, average.device_mesh, average.placements, src_data_rank=None)
    return average.copy_(full.float())


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)
