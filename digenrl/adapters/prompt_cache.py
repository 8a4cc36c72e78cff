"""Prompt embeddings of a fixed prompt set, encoded once per run and reused.

Details: docs/modules.md, `digenrl.adapters.prompt_cache`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from digenrl.adapters.cond import Cond


class PromptEmbeddingCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows: OrderedDict[str, Cond] = OrderedDict()  # prompt -> its one-row conditioning (CPU)
        self.encoded = 0  # prompts sent to the encoder so far

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows.clear()

    def lookup(self, prompts: list[str], encode: Callable[[list[str]], Cond]) -> Cond:
        """The conditioning of ``prompts`` (CPU, in order); only prompts not held are encoded, in one
        batch."""
        if self.capacity == 0:
            self.encoded += len(prompts)
            return encode(prompts).to("cpu")
        missing = list(dict.fromkeys(p for p in prompts if p not in self.rows))
        fresh = {}
        if missing:
            cond = encode(missing).to("cpu")
            self.encoded += len(missing)
            fresh = {p: _row(cond, i) for i, p in enumerate(missing)}
        out = Cond.cat([fresh[p] if p in fresh else self.rows[p] for p in prompts])
        for p in prompts:  # most recently used last; the least recently used leave first
            if p in fresh:
                self.rows[p] = fresh[p]
            self.rows.move_to_end(p)
        while len(self.rows) > self.capacity:
            self.rows.popitem(last=False)
        return out


def _row(cond: Cond, i: int) -> Cond:
    """Row ``i`` as its own tensors (a view would keep the whole encoded batch alive)."""
    one = {k: v[i : i + 1].clone() for k, v in cond.batched.items()}
    return Cond(one, cond.shared, {k: v[i : i + 1].clone() for k, v in cond.host.items()})
