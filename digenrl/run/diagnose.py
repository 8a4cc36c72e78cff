"""Why the reward is not increasing: per-iteration group statistics for ``metrics.jsonl`` and, at the
end of a run whose reward stayed flat, one plain line naming the metric that points at the cause.

Flow-GRPO-style learning needs three things, each visible in the rows: groups whose samples get
different rewards (``groups_zero_std``: the share of groups with none -- their advantages are 0, they
teach nothing; ``reward_std_in_group``: the mean spread inside a group), a policy that moves (``kl``,
``ratio_min`` / ``ratio_max`` away from 1) but not so far that the clip drops the gradient
(``clip_frac``), and components that do not pull against each other (``reward/<name>``).
"""

from __future__ import annotations

import math

import torch

#: a group whose rewards span at most this is "zero-variance" (rewards are floats: exact ties are rare
#: but a saturated reward gives them; a 1e-6 spread is rounding)
TIE = 1e-6


def group_metrics(units: list) -> dict[str, float]:
    """``groups_zero_std`` and ``reward_std_in_group`` of an iteration's units of whole groups (anything
    with ``rewards`` and ``group_ids``, samples of a group consecutive); NaN rewards left out."""
    spans, stds = [], []
    for u in units:
        g = len(u.rewards) // len(u.group_ids)
        for r in u.rewards.float().view(-1, g):
            r = r[~torch.isnan(r)]
            if len(r) > 1:
                spans.append((r.max() - r.min()).item())
                stds.append(r.std().item())
    if not spans:
        return {}
    return {
        "groups_zero_std": sum(s <= TIE for s in spans) / len(spans),
        "reward_std_in_group": sum(stds) / len(stds),
    }


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else None


def is_flat(rows: list[dict]) -> bool:
    """The reward's gain, last third over first third of the iterations, is within two standard errors
    of the per-iteration means (needs 6 iterations)."""
    k = len(rows) // 3
    if k < 2:
        return False
    first = [r["reward_mean"] for r in rows[:k] if math.isfinite(r.get("reward_mean", math.nan))]
    last = [r["reward_mean"] for r in rows[-k:] if math.isfinite(r.get("reward_mean", math.nan))]
    if len(first) < 2 or len(last) < 2:
        return False

    def var(x):
        m = sum(x) / len(x)
        return sum((v - m) ** 2 for v in x) / (len(x) - 1)

    gain = sum(last) / len(last) - sum(first) / len(first)
    return gain < 2 * math.sqrt(var(first) / len(first) + var(last) / len(last))


def diagnosis(rows: list[dict], clip_range: float | None = None, kl_beta: float = 0.0) -> str | None:
    """One plain line for a flat run (:func:`is_flat`) saying which metric points where; None otherwise."""
    if not is_flat(rows):
        return None
    said = "the reward did not increase (its gain is within the iteration-to-iteration noise)"
    zero = _mean(rows, "groups_zero_std")
    if zero is not None and zero >= 0.5:
        return (
            f"{said}: in {zero:.0%} of the groups every sample got the same reward, so their advantages are "
            "0 and they teach nothing -- make the reward finer-grained, the prompts neither too easy nor too "
            "hard, or the groups larger (algorithm.group_size)"
        )
    clip = _mean(rows, "clip_frac")
    if clip is not None and clip >= 0.3:
        return (
            f"{said}: {clip:.0%} of the trained terms were clipped (ratio outside 1 +- algorithm.clip_range"
            f"{f' = {clip_range:g}' if clip_range else ''}), their gradient dropped -- lower train.lr or "
            "raise algorithm.clip_range"
        )
    k = max(1, len(rows) // 3)
    parts = sorted({key for r in rows for key in r if key.startswith("reward/")})
    trends = {p: (_mean(rows[-k:], p) or 0.0) - (_mean(rows[:k], p) or 0.0) for p in parts}
    up = [p for p, d in trends.items() if d > 0]
    down = [p for p, d in trends.items() if d < 0]
    if up and down and len(parts) > 1:
        worst, best = min(down, key=trends.get), max(up, key=trends.get)
        return (
            f"{said}: {best} rose ({trends[best]:+.4f}) while {worst} fell ({trends[worst]:+.4f}) -- the "
            "components pull against each other; check reward.components' weights"
        )
    kl = _mean(rows, "kl")
    if kl_beta > 0 and kl is not None and clip is not None and clip < 0.01:
        return (
            f"{said}: the policy hardly moves (clip fraction {clip:.1%}) under the KL penalty "
            f"(algorithm.kl_beta {kl_beta:g}, KL {kl:.2e}) -- lower algorithm.kl_beta or raise train.lr"
        )
    if clip is not None and clip < 0.001:
        return (
            f"{said}: the policy hardly moves (clip fraction {clip:.2%}, ratio within "
            f"[{_mean(rows, 'ratio_min') or 1:.4f}, {_mean(rows, 'ratio_max') or 1:.4f}]) -- raise train.lr"
        )
    spread = _mean(rows, "reward_std_in_group")
    return (
        f"{said}; no single metric stands out (zero-variance groups {zero or 0:.0%}, reward std in a group "
        f"{spread or 0:.4f}, clip fraction {clip or 0:.1%}): run longer, or see docs/algorithms.md"
    )
