"""Peak memory of what torch allocates inside a block, on a CPU: a ``TorchDispatchMode`` counts the
storage of every tensor an op returns that is new (not one of its inputs' storages), from its
allocation until the last tensor viewing it is freed -- a CPU stand-in for
``torch.cuda.max_memory_allocated``, which counts what the block's ops allocated beyond what it held
before."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.views: dict[int, int] = {}  # storage address -> live tensors viewing it
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._hold(t, inputs)
        return out

    def _hold(self, t: torch.Tensor, inputs: set) -> None:
        key = _key(t)
        if not key or (key in inputs and key not in self.views):  # a view of what was held before
            return
        if key not in self.views:
            self.views[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.views[key] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        self.views[key] -= 1
        if not self.views[key]:
            self.live -= self.sizes.pop(key)
            del self.views[key]


def _key(t: torch.Tensor) -> int:
    return 0 if t.is_meta else t.untyped_storage().data_ptr()
