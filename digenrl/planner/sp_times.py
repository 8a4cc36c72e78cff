"""A worker of several devices under Ulysses sequence parallelism: each call's time split over them,
its kernels paid whole on each, plus the all-to-alls. Details: docs/modules.md,
`digenrl.planner.call_times`."""

from __future__ import annotations

from digenrl.planner.call_times import CallTimes
from digenrl.planner.workload import Workload


class SequenceParallelTimes(CallTimes):
    """A worker of ``sp`` devices (Ulysses sequence parallelism): every transformer call's time over
    ``sp`` (each device computes 1/sp of the tokens; the weights are read by every device, so a
    call bound by weight streaming gains less than this says), plus the all-to-alls: four per
    attention layer and pass (q, k, v in; the output back), each moving (sp-1)/sp of a device's
    activations of that layer over the link; the backward moves them again. Everything else (encode,
    decode, reward, optimizer, sync) runs as on one device."""

    def __init__(self, inner: CallTimes, w: Workload, sp: int, link_bw: float):
        self.inner, self.workload, self.sp, self.link_bw = inner, w, sp, link_bw
        self.source = f"{inner.source}, SP x{sp}"
        for name in ("rollout_overhead_s", "train_overhead_s", "rollout_unit_factor", "train_unit_factor"):
            setattr(self, name, getattr(inner, name))

    def all_to_all(self, b: float) -> float:
        """One pass's all-to-alls for a batch of ``b`` samples, per device."""
        w, t = self.workload, self.workload.shape.tokens
        layer = b * (t.x + t.text) / self.sp * w.params.hidden * w.dtype_bytes * (self.sp - 1) / self.sp
        return 4 * w.params.blocks * layer / self.link_bw

    def _split(self, t: float, call: str) -> float:
        """A call's time over ``sp`` devices, its kernels' launches paid whole on each."""
        k = self.inner.kernels_s(call)
        return (t - k) / self.sp + k

    def rollout_step(self, b):
        return self._split(self.inner.rollout_step(b), "rollout") + self.workload.passes * self.all_to_all(b)

    def train_step(self, b):
        return self._split(self.inner.train_step(b), "train") + 2 * self.workload.passes * self.all_to_all(b)

    def ref_forward(self, b):
        return self._split(self.inner.ref_forward(b), "ref") + self.workload.passes * self.all_to_all(b)

    def decode(self, b):
        return self.inner.decode(b)

    def reward(self, b):
        return self.inner.reward(b)

    def reward_wait(self, b):
        return self.inner.reward_wait(b)

    def encode(self, prompts):
        return self.inner.encode(prompts)

    def optimizer(self):
        return self.inner.optimizer()

    def pack(self):
        return self.inner.pack()

    def agree(self):
        return self.inner.agree()

    def load(self):
        return self.inner.load()
