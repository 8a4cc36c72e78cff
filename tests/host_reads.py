"""Counting host syncs on a CPU: a tensor subclass stands for a tensor on the accelerator.

Whatever is computed from an :class:`OnDevice` tensor is one too (``__torch_function__`` keeps the
subclass through every op, parameters and constants mixed in), so reading one on the host -- what waits
for the GPU queue to drain there (``.item()``, ``bool()``, ``float()``, ``.tolist()``, ``.cpu()``, a
size that depends on its values: ``nonzero``, a boolean index) -- is recorded in
:attr:`OnDevice.reads`. Tensors made on the host (a schedule, row indices) stay plain and are free to
read. Inside :func:`counted`, what is moved or made with a device is an :class:`OnDevice` tensor."""

from __future__ import annotations

import contextlib
import traceback

import torch

#: reads whose answer the host must wait for
READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy", "nonzero"}
READS |= {"masked_select", "unique", "unique_consecutive", "argwhere", "nonzero_static"}


class OnDevice(torch.Tensor):
    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or (name == "__getitem__" and _mask(args)):
            cls.reads.append(f"{name} at {_caller()}")
        return super().__torch_function__(func, types, args, kwargs)


def _caller() -> str:
    """The innermost frame of the project's code (or diffusers') that made the read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_reads.py"):
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"
    return "?"


def _mask(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, OnDevice) and p.dtype == torch.bool for p in parts)


def on_device(value):
    """``value`` (a tensor, or a dict / list / tuple of them) as :class:`OnDevice` tensors."""
    if isinstance(value, torch.Tensor):
        return value.as_subclass(OnDevice)
    if isinstance(value, dict):
        return {k: on_device(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v) for v in value)
    return value


#: factories whose result is on the device when they are given one
FACTORIES = ("empty", "zeros", "ones", "full", "randn", "rand", "randint", "arange", "tensor", "as_tensor")


def _placed(args, kwargs) -> bool:
    """A ``.to(...)`` / factory call given a device (or a device tensor to follow)."""
    where = (*args, kwargs.get("device"), kwargs.get("other"))
    return any(isinstance(a, (str, torch.device)) or isinstance(a, OnDevice) for a in where)


@contextlib.contextmanager
def counted():
    """The host reads of device tensors inside the block (a list, filled as the block runs). Inside,
    a tensor moved or made with a device (``.to(device)``, ``torch.zeros(..., device=...)``) is a
    device tensor: on a CPU the device is the host, so the move is what marks it."""
    OnDevice.reads = []
    to, made = torch.Tensor.to, {name: getattr(torch, name) for name in FACTORIES}

    def moved(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        return out.as_subclass(OnDevice) if _placed(args, kwargs) and not isinstance(out, OnDevice) else out

    def factory(real):
        def make(*args, **kwargs):
            out = real(*args, **kwargs)
            return out.as_subclass(OnDevice) if kwargs.get("device") is not None else out

        return make

    torch.Tensor.to = moved
    for name, real in made.items():
        setattr(torch, name, factory(real))
    try:
        yield OnDevice.reads
    finally:
        torch.Tensor.to = to
        for name, real in made.items():
            setattr(torch, name, real)
