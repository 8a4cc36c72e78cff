"""Rewards: a registry of scorers and their weighted combination.

Details: docs/modules.md, `digenrl.rewards`.
"""

from __future__ import annotations

import re
import time

import torch

from digenrl.config.train import FUNCTION_REWARDS, RewardConfig  # noqa: F401  (FUNCTION_REWARDS re-exported)
from digenrl.errors import UserError
from digenrl.rewards import basic, clip_models, geneval, hps, ocr, remote, smallworld, structure, vlm_judge  # noqa: F401  (importing them registers them)
from digenrl.rewards.base import REWARDS, Reward, RewardArgError, register  # noqa: F401  (re-exported)


def _frame_stride(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RewardArgError("frame_stride", f"must be a positive integer (got {value!r})")
    return value


def reward_kind(name: str) -> str:
    """The registry entry of a component name: ``kind`` or ``kind:label`` (the label tells apart two
    components of one kind, e.g. ``remote:hpsv2`` and ``remote:unifiedreward``; logged under the full
    name)."""
    return name.split(":", 1)[0]


def scored_after_unit(cfg) -> bool:
    """Whether a run scores its rollout units after them, on the rollout workers' devices, overlapped
    with their next unit (``EngineWorker.score``): a disaggregated run with a model reward (or a remote
    judge) and no ``reward.service``. Its trainer ranks never build the reward."""
    kinds = {reward_kind(c.name) for c in cfg.reward.components}
    return (
        cfg.placement.mode == "disaggregated"
        and cfg.reward.service is None
        and bool(kinds - FUNCTION_REWARDS)
    )


class CombinedReward:
    """Weighted sum of the configured components; also returns each component for logging.

    ``__call__`` returns ``(total, parts)``: CPU float tensors, ``parts`` keyed by reward name.
    A NaN score fails (``nan_policy: fail``) or is passed on (``drop``: the total is NaN too, and
    advantages leave the sample out); an infinite score, a wrong shape or a non-tensor always fail.
    ``last_timings`` holds the seconds each component took in the latest call.
    """

    def __init__(self, cfg: RewardConfig, load_models: bool = True):
        """``load_models=False`` (the preflight): a model reward's arguments and files are checked, not
        loaded; it scores 0 (:class:`Unloaded`) in a dry run."""
        self.terms: list[tuple[str, float, Reward]] = []
        for i, term in enumerate(cfg.components):
            where = f"reward.components.{i}"
            kind = reward_kind(term.name)
            if kind not in REWARDS:
                raise UserError(
                    f"{where}: unknown reward '{term.name}' (available: {', '.join(sorted(REWARDS))})"
                )
            args = dict(term.args)
            try:
                stride = _frame_stride(args.pop("frame_stride", 1))
                cls = REWARDS[kind]
                if not load_models and cls.loads_model:
                    cls.check_args(**args)
                    fn = Unloaded()
                else:
                    fn = cls(**args)
            except RewardArgError as exc:
                raise UserError(f"{where}.args.{exc.arg}: reward '{term.name}': {exc.message}") from None
            except TypeError as exc:  # "X.__init__() got an unexpected ...": the same line from check_args
                what = re.sub(r"^[\w.]+\(\) ", "", str(exc))
                raise UserError(f"{where}.args: reward '{term.name}': {what}") from None
            except UserError as exc:  # e.g. its optional extra is not installed
                raise UserError(f"{where}: {exc}") from None
            fn.frame_stride = stride
            self.terms.append((term.name, term.weight, fn))
        self.nan_policy = cfg.nan_policy
        self.last_timings: dict[str, float] = {}

    @property
    def weights(self) -> dict[str, float]:
        return {name: w for name, w, _ in self.terms}

    def __call__(self, pixels, prompts, metadata=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(pixels, torch.Tensor) and not torch.isfinite(pixels).all():  # not the reward's fault
            raise UserError(
                "train.lr: the generated samples hold NaN / inf pixels (the policy diverged); most "
                "likely train.lr is too large or model.dtype float16 overflowed"
            )
        parts, timings = {}, {}
        for name, _, fn in self.terms:
            t0 = time.perf_counter()
            r = fn(pixels, prompts, metadata)
            timings[name] = time.perf_counter() - t0
            parts[name] = self._validated(name, r, len(prompts), self.nan_policy)
        self.last_timings = timings
        total = sum(w * parts[name] for name, w, _ in self.terms)
        return total, parts

    @staticmethod
    def _validated(name: str, r, n: int, nan_policy: str, context: str = "") -> torch.Tensor:
        if not isinstance(r, torch.Tensor):
            raise UserError(
                f"reward '{name}'{context} returned {type(r).__name__}, expected a tensor of shape ({n},)"
            )
        r = r.detach().float().cpu()
        if r.shape != (n,):
            raise UserError(f"reward '{name}'{context} returned shape {tuple(r.shape)}, expected ({n},)")
        if torch.isinf(r).any():
            raise UserError(
                f"reward '{name}'{context} returned inf for {int(torch.isinf(r).sum())} of {n} samples"
            )
        nans = int(torch.isnan(r).sum())
        if nans and (nan_policy == "fail" or nans == n):
            hint = " (set reward.nan_policy=drop to skip them)" if nan_policy == "fail" else ""
            raise UserError(f"reward '{name}'{context} returned NaN for {nans} of {n} samples{hint}")
        return r

    def check(
        self,
        prompts: list[str],
        shape: tuple[int, ...],
        metadata: list[dict] | None = None,
        n: int = 2,
        seed: int = 0,
    ) -> dict[str, float]:
        """Dry run before training: score ``n`` random samples of one sample's pixel ``shape``
        ((C,H,W) or (C,F,H,W), as the adapter decodes) with the run's own prompts.

        Raises a UserError naming the reward that crashes, returns the wrong shape, inf, or NaN
        (any NaN with ``nan_policy: fail``; NaN for every sample with ``drop``). Returns the
        seconds each component took.
        """
        if not prompts:
            raise ValueError("check needs at least one prompt")
        pixels = torch.rand((n, *shape), generator=torch.Generator().manual_seed(seed))
        texts = [prompts[i % len(prompts)] for i in range(n)]
        metas = [(metadata or [{}] * len(prompts))[i % len(prompts)] for i in range(n)]
        context = f" in its dry run on {n} random samples of shape {tuple(shape)}"
        timings = {}
        for i, (name, _, fn) in enumerate(self.terms):
            t0 = time.perf_counter()
            try:
                r = fn(pixels, texts, metas)
            except UserError as exc:
                raise UserError(f"reward.components.{i}: reward '{name}' failed{context}: {exc}") from None
            except Exception as exc:  # a reward that cannot score the run's samples: stop before training
                raise UserError(
                    f"reward.components.{i}: reward '{name}' failed{context}: {type(exc).__name__}: {exc}"
                ) from exc
            timings[name] = time.perf_counter() - t0
            self._validated(name, r, n, self.nan_policy, context)
        return timings


class Unloaded(Reward):
    """The preflight's stand-in for a model reward whose arguments were checked, not loaded: scores 0."""

    def score(self, images, prompts, metadata):
        return torch.zeros(len(prompts))


def reward_metrics(rewards: torch.Tensor, parts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Metrics of an iteration's rewards that NaN (``nan_policy: drop``) cannot poison:
    ``reward_mean`` / ``reward_std`` / ``reward/<name>`` over the scored samples, ``reward_nan``
    the number of dropped ones."""
    rewards = rewards.float()
    ok = ~torch.isnan(rewards)
    kept = rewards[ok]
    row = {
        "reward_mean": kept.mean().item() if len(kept) else float("nan"),
        "reward_std": kept.std().item() if len(kept) > 1 else 0.0,
        "reward_nan": int((~ok).sum()),
    }
    for name, r in parts.items():
        row[f"reward/{name}"] = r.float().nanmean().item()
    return row


def build_reward(cfg: RewardConfig, load_models: bool = True) -> CombinedReward:
    """The configured rewards, their models loaded (``load_models=False``: checked, not loaded; what
    the preflight builds). Building them draws nothing from torch's global CPU generator (a model
    head's init would): the policy built next gets the same initial weights in every process, whether
    or not that process builds the rewards (with ``reward.service`` only the reward actor does)."""
    with torch.random.fork_rng(devices=[]):
        return CombinedReward(cfg, load_models)
