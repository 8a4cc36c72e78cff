"""Prompt conditioning as it travels from the text encoders to the transformer (and from rollout
to training)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Cond:
    """Prompt conditioning, batch-first; travels with the samples from rollout to training.

    ``batched`` tensors have the batch on dim 0; ``shared`` ones (e.g. FLUX ``txt_ids``) do not.
    ``host``: batch-first tensors that stay on the CPU wherever the rest goes (each row's valid text
    length: a forward trims its text to its rows' longest without reading the device mask).
    """

    batched: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    host: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return next(iter(self.batched.values())).shape[0]

    def select(self, idx, host_idx=None) -> Cond:
        """Rows ``idx``; ``host_idx``: the same rows on the CPU, where ``idx`` is on the device."""
        return Cond(
            {k: v[idx] for k, v in self.batched.items()}, self.shared, _host_rows(self.host, idx, host_idx)
        )

    def repeat_interleave(self, n: int) -> Cond:
        return Cond(
            {k: v.repeat_interleave(n, dim=0) for k, v in self.batched.items()},
            self.shared,
            {k: v.repeat_interleave(n, dim=0) for k, v in self.host.items()},
        )

    def to(self, device) -> Cond:
        return Cond(
            {k: v.to(device) for k, v in self.batched.items()},
            {k: v.to(device) for k, v in self.shared.items()},
            self.host,
        )

    def text_len(self, key: str, full: int) -> int:
        """The longest valid text of these rows (``host[key]``), at least 1; ``full`` (no trim) without it."""
        if key not in self.host or len(self.host[key]) == 0:
            return full
        return max(1, int(self.host[key].max()))

    @staticmethod
    def cat(conds: list[Cond]) -> Cond:
        keys = conds[0].batched.keys()
        host = set.intersection(*(set(c.host) for c in conds))  # a key some lack: dropped (no trim)
        return Cond(
            {k: torch.cat([c.batched[k] for c in conds]) for k in keys},
            conds[0].shared,
            {k: torch.cat([c.host[k] for c in conds]) for k in sorted(host)},
        )


def _host_rows(host: dict[str, torch.Tensor], idx, host_idx) -> dict[str, torch.Tensor]:
    """``host`` at the selected rows; an index on the device and no host copy: every row gets the
    whole batch's maximum (a bound, so a trim stays exact; reading the index would wait for the device)."""
    idx = idx if host_idx is None else host_idx
    if isinstance(idx, torch.Tensor) and idx.device.type != "cpu":
        return {k: v.max().expand(len(idx)).clone() for k, v in host.items() if len(v)}
    return {k: v[idx] for k, v in host.items()}
