"""What a rank holds on its device while it builds and shards its model, without the device: a
``TorchDispatchMode`` that counts every storage an op creates on one device type (``meta`` too, which
stands in for the GPU in the CPU audits: real shapes and dtypes, no data), from its creation until it
is freed, whoever holds it (an ``nn.Parameter`` or a DTensor's shard). Its peak is what the caching
allocator's ``max_memory_allocated`` would count, less fragmentation. Used by
benchmarks/meta_memory_audit.py (the build column) and tests/test_sharded_build.py."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class DeviceBytes(TorchDispatchMode):
    """``live`` / ``peak``: bytes of the storages created on ``device_type`` inside the block that are
    alive now / were alive together at most; ``largest``: the largest one."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.held: dict[int, tuple[StorageWeakRef, int]] = {}  # storage address -> (ref, bytes)
        self.live = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            t = getattr(t, "_local_tensor", t)  # a DTensor: its shard
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._hold(t.untyped_storage())
        return out

    def _hold(self, storage) -> None:
        key = storage._cdata
        known = self.held.get(key)
        if known is not None and not known[0].expired():
            return  # a view of a storage already counted
        self._forget_freed()
        size = storage.nbytes()
        self.held[key] = (StorageWeakRef(storage), size)
        self.live += size
        self.peak, self.largest = max(self.peak, self.live), max(self.largest, size)

    def _forget_freed(self) -> None:
        for key, (ref, size) in list(self.held.items()):
            if ref.expired():
                del self.held[key]
                self.live -= size
