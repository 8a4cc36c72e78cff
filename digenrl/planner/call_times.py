"""Seconds per call on one device type, and the rollout / train unit durations composed from them.

Details: docs/modules.md, `digenrl.planner.call_times`.
"""

from __future__ import annotations

from digenrl.placement.devices import DeviceSpec
from digenrl.planner.constants import (
    FINGERPRINT_KERNELS,
    FINGERPRINT_PASSES,
    KERNEL_LAUNCH_S,
    MIN_CALL_FRACTION,
    MIN_UNIT_FRACTION,
    OPTIMIZER_FIXED_S,
    OPTIMIZER_STATE_PASSES,
)
from digenrl.planner.efficiency import device_efficiency
from digenrl.planner.op_counts import forward_ops
from digenrl.planner.params import CostParams
from digenrl.planner.shapes import attention_fraction, forward_flops
from digenrl.planner.workload import Workload


def interpolate(table: dict[int, float], b: float) -> float:
    """Piecewise-linear in the batch size; beyond the table, along its last (or first) segment."""
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]] * b / xs[0]
    if b <= xs[0]:
        x0, x1 = xs[0], xs[1]
    elif b >= xs[-1]:
        x0, x1 = xs[-2], xs[-1]
    else:
        i = next(i for i, x in enumerate(xs) if x >= b)
        x0, x1 = xs[i - 1], xs[i]
    y0, y1 = table[x0], table[x1]
    y = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
    if b < xs[0]:  # below the table: a smaller batch costs no more than the smallest measured one, and
        # no less per sample (a noisy first segment extrapolated to b -> 0 would make small batches free)
        return min(table[xs[0]], max(y, table[xs[0]] * b / xs[0]))
    return max(y, min(y0, y1) * MIN_CALL_FRACTION)


def reward_per_image(w: Workload, p: CostParams) -> tuple[float, float]:
    """(seconds on the scoring device or its host, seconds waiting for a remote judge) per image of the
    configured rewards: each component's ``seconds_per_image``, else its kind's default (a function
    ``weight_free_reward_s``, a model ``model_reward_s``, a remote judge ``remote_reward_s``). A
    workload without components (``Workload.reward_terms`` empty) is one term of ``reward_kind``; one
    marked ``model`` whose components are all functions (a published setup's judge) is one model term."""
    terms = w.reward_terms
    if not terms or (w.reward_kind == "model" and all(k == "function" for k, _ in terms)):
        terms = (("model" if w.reward_kind == "model" else "function", None),)
    default = {"function": p.weight_free_reward_s, "model": p.model_reward_s, "remote": p.remote_reward_s}
    default["host"] = p.model_reward_s  # (a host model is charged its measured seconds: MEASURED_REWARD_S)
    here = sum(default[k] if s is None else s for k, s in terms if k != "remote")
    wait = sum(default[k] if s is None else s for k, s in terms if k == "remote")
    return here, wait


class CallTimes:
    """Seconds per call on one device type. ``b`` = batch size (may be fractional in expectations)."""

    source = ""

    def rollout_step(self, b: float) -> float: ...  # one velocity call, all guidance passes, no grad
    def train_step(self, b: float) -> float: ...  # forward + backward of recompute_logprob
    def ref_forward(self, b: float) -> float: ...  # the KL reference forward (no grad)
    def decode(self, b: float) -> float: ...
    def reward(self, b: float) -> float: ...  # every component, the remote judges' wait included

    def reward_wait(self, b: float) -> float:
        """Of :meth:`reward`, the seconds a remote judge takes while the scoring device is idle (a
        profile measured the whole reward on its device: none)."""
        return 0.0

    def kernels_s(self, call: str) -> float:
        """Of a ``call`` ("rollout" | "train" | "ref"), the seconds its kernels' launches take whatever
        its size: every device of a sequence-parallel worker pays them whole (a profile: none apart)."""
        return 0.0

    def encode(self, prompts: int) -> float: ...
    def optimizer(self) -> float: ...
    def pack(self) -> float: ...  # Policy.weights() + checksum
    def agree(self) -> float: ...  # Policy.agreement_digest: the trainer ranks' check after a step
    def load(self) -> float: ...  # verified load of shipped weights

    def load_staged(self) -> float:
        """A broadcast version's load at the unit boundary (copy from the staging buffers + one
        fingerprint check); a profile measures the object-store load only, which bounds it."""
        return self.load()

    rollout_overhead_s = (
        0.0  # per unit, beyond its calls (analytic model; profiles of version 1 before factors)
    )
    train_overhead_s = 0.0
    rollout_unit_factor = (
        1.0  # a whole unit / the sum of its calls, as profiled (CPU engine: SDE / loss math)
    )
    train_unit_factor = 1.0


class ProfiledTimes(CallTimes):
    """From a profile.json measured on this device type."""

    def __init__(self, profile: dict):
        self.profile = profile
        self.source = f"profile ({profile['device']['name']})"
        m = profile["measurements"]
        self._roll = {int(k): v for k, v in m["rollout_step_s"].items()}
        self._train = {int(k): v for k, v in m["train_step_s"].items()}
        self._ref = {int(k): v for k, v in m.get("ref_forward_s", m["rollout_step_s"]).items()}
        u = m.get("unit_overhead") or {}
        if "rollout_factor" in u:  # whole units measured at the run's unit size: scale by the ratio
            self.rollout_unit_factor, self.train_unit_factor = u["rollout_factor"], u["train_factor"]
        else:  # older profiles: the difference in seconds, measured on a unit of one group
            self.rollout_overhead_s, self.train_overhead_s = u.get("rollout_s", 0.0), u.get("train_s", 0.0)

    def rollout_step(self, b):
        return interpolate(self._roll, b)

    def train_step(self, b):
        return interpolate(self._train, b)

    def ref_forward(self, b):
        return interpolate(self._ref, b)

    def decode(self, b):
        return b * self.profile["measurements"]["decode_s_per_sample"]

    def reward(self, b):
        return b * self.profile["measurements"]["reward_s_per_sample"]

    def encode(self, prompts):
        return prompts * self.profile["measurements"]["encode_s_per_prompt"]

    def optimizer(self):
        return self.profile["measurements"]["optimizer_step_s"]

    def pack(self):
        return self.profile["measurements"]["weight_sync"]["pack_s"]

    def agree(self):  # profiles before the on-device digest measured the host copy + SHA-256 only
        ws = self.profile["measurements"]["weight_sync"]
        return ws.get("agree_s", ws["pack_s"])

    def load(self):
        return self.profile["measurements"]["weight_sync"]["load_s"]


class AnalyticTimes(CallTimes):
    """FLOPs / (peak x MFU), bounded below by streaming the weights once per pass."""

    def __init__(
        self,
        w: Workload,
        dev: DeviceSpec,
        p: CostParams,
        checkpointing: bool = False,
        shard: int = 1,
        link_bw: float | None = None,
        cfg_batched: bool = True,
        fused: bool = False,
    ):
        self.workload, self.dev, self.params = w, dev, p
        self.checkpointing, self.shard, self.cfg_batched = checkpointing, shard, cfg_batched
        self.efficiency = device_efficiency(p, dev.name)
        e = self.efficiency
        self.source = (
            f"analytic ({dev.name}, kernel efficiency {e.rollout:.3f} sampling / {e.train:.3f} training "
            f"at large calls, half at {e.half_tokens_rollout:.0f} / {e.half_tokens_train:.0f} tokens; "
            f"{e.source})"
        )
        self.flops = forward_flops(w.shape)  # one pass, one sample
        self.attention = attention_fraction(w.shape)  # of it, attention's score / value products
        self.sample_tokens = w.shape.tokens.x + w.shape.tokens.text  # tokens one sample's pass processes
        self.weight_bytes = w.params.total * w.dtype_bytes
        self.rollout_overhead_s = self.train_overhead_s = p.unit_overhead_s
        # FSDP: every pass all-gathers the weights (and the backward reduce-scatters full-FT gradients)
        # ``fused``: the transformer as a serving engine runs it (fused norms and QKV: op_counts.py)
        self.ops = forward_ops(w.shape, fused) if p.op_launch_s is not None else None
        self.fsdp_s = 0.0
        if shard > 1:
            moved = self.weight_bytes * (shard - 1) / shard / (link_bw or dev.link_bw)
            self.fsdp_s = (1 - p.fsdp_overlap) * moved

    def _pass(
        self, b: float, kind: str, flop_factor: float, weight_reads: float, kernels: float = 1.0
    ) -> float:
        """One transformer call over ``b`` samples: FLOPs at the kernel efficiency this call's token
        count reaches (``kind`` "rollout" | "train"), or streaming the weights, whichever is slower."""
        tokens = b * self.sample_tokens
        e = self.efficiency
        mfu = e.rollout_at(tokens) if kind == "rollout" else e.train_at(tokens)
        compute = b * self.flops * flop_factor / (self.dev.bf16_flops * mfu)
        bw = self.dev.mem_bw * self.params.mem_bw_efficiency
        stream = weight_reads * self.weight_bytes / bw
        if self.ops is None:
            return max(compute, stream) + self.params.forward_overhead_s
        # the counted ops' launches and memory-bound traffic, x ``kernels`` forwards' worth (a backward
        # runs ~2x a forward's kernels; a checkpointed one re-runs the forward)
        ops, elems = self.ops
        traffic = b * elems * self.workload.dtype_bytes / bw if self.params.op_traffic else 0.0
        return max(compute, stream) + kernels * (ops * self.params.op_launch_s + traffic)

    def kernels_s(self, call: str) -> float:
        if self.ops is None:
            return 0.0
        one = self.ops[0] * self.params.op_launch_s
        if call == "rollout":
            return one * (1 if self.cfg_batched else self.workload.passes)
        if call == "ref":
            return one * self.workload.passes
        return one * self.workload.passes * (3.0 + (1.0 if self.checkpointing else 0.0))

    def rollout_step(self, b):
        if self.cfg_batched:  # every guidance pass in one forward of passes x b
            return self._pass(self.workload.passes * b, "rollout", 1.0, 1.0) + self.fsdp_s
        return self.workload.passes * (self._pass(b, "rollout", 1.0, 1.0) + self.fsdp_s)

    def train_step(self, b):
        # LoRA: no weight gradients for the frozen base
        backward = 2.0 if not self.workload.lora else 1.0 + self.attention
        factor = 1.0 + backward + (1.0 if self.checkpointing else 0.0)
        reads = 2.0 + (1.0 if self.checkpointing else 0.0)
        fsdp = self.fsdp_s * (3 if not self.workload.lora else 2)
        t = self.workload.passes * (self._pass(b, "train", factor, reads, reads + 1.0) + fsdp)
        if (
            self.workload.passes > 1 and not self.cfg_batched
        ):  # sequential CFG runs the unconditional forward twice
            t += self.ref_forward(b) / self.workload.passes
        return t

    def ref_forward(self, b):
        return self.workload.passes * (self._pass(b, "train", 1.0, 1.0) + self.fsdp_s)

    def decode(self, b):
        t = self.workload.shape.tokens
        return (
            b
            * t.pixels
            * self.workload.shape.vae_decode_flops_per_px
            / (self.dev.bf16_flops * self.params.vae_mfu)
        )

    def reward(self, b):
        return b * sum(reward_per_image(self.workload, self.params)) * self.workload.video_frames

    def reward_wait(self, b):
        return b * reward_per_image(self.workload, self.params)[1] * self.workload.video_frames

    def encode(self, prompts):
        te = self.workload.shape.text_encoder_params
        if not te:
            return 0.0
        flops = 2 * te * self.workload.shape.tokens.text
        return prompts * (
            flops / (self.dev.bf16_flops * self.efficiency.rollout) + self.params.forward_overhead_s
        )

    def optimizer(self):
        n = self.workload.trained_params / (self.shard if not self.workload.lora else 1)
        stream = OPTIMIZER_STATE_PASSES * n * self.params.trained_state_bytes
        return stream / (self.dev.mem_bw * self.params.mem_bw_efficiency) + OPTIMIZER_FIXED_S

    def pack(self):
        b = self.workload.sync_bytes
        return b / self.dev.host_bw + b / self.params.checksum_bytes_per_s

    def agree(self):
        """Every trained tensor fingerprinted where it lives (memory-bound passes over its bytes, a
        few kernels each), one (n, 3) host copy; nothing of the weights crosses to the host."""
        bw = self.dev.mem_bw * self.params.mem_bw_efficiency
        stream = FINGERPRINT_PASSES * self.workload.sync_bytes / bw
        return stream + FINGERPRINT_KERNELS * KERNEL_LAUNCH_S * self.workload.params.lora_tensors

    def load(self):
        b = self.workload.sync_bytes
        return b / self.dev.host_bw + 2 * b / self.params.checksum_bytes_per_s

    def load_staged(self):
        b = self.workload.sync_bytes
        return b / self.dev.host_bw + b / self.params.checksum_bytes_per_s


def minibatch_samples(w: Workload, groups: float) -> list[float]:
    """Samples of each of the S mini-batches in a rollout unit of ``groups`` prompt groups (mini-batch
    s: samples s*G/S .. (s+1)*G/S - 1 of every group); a fraction 1/P is a part of one group, its
    first part (samples 0 .. G/P - 1) standing for every part."""
    G, S = w.group_size, w.optimizer_steps
    whole, held = (groups, G) if groups >= 1 else (1.0, groups * G)  # groups, samples of each held
    per = G / S
    return [whole * max(0.0, min(held, (s + 1) * per) - s * per) for s in range(S)]


def micro_batches(b: float, micro_batch: int) -> list[float]:
    """``b`` samples as forwards of ``micro_batch`` samples, the last one partial."""
    full, rest = divmod(b, micro_batch)
    return [float(micro_batch)] * int(full) + ([rest] if rest > 1e-9 else [])


def rollout_unit_time(
    t: CallTimes, w: Workload, groups: float, batch: int | None = None
) -> tuple[float, float]:
    """(seconds, of which reward): encode the prompts, N steps of the forwards over b = groups x G
    samples, decode, score. The forwards are the train forwards' batches (bit-exact ratio), or with
    ``batch`` (a rollout-only worker sampling at its own batch, ``engine.rollout_batch``) batches of
    that size -- the kernel efficiency of each follows its token count (efficiency.py)."""
    b = groups * w.group_size
    if batch:
        forwards = micro_batches(b, batch)
    elif w.forward_process:  # diffusion_nft: one forward of the whole unit per step (no log-probs to match)
        forwards = [b]
    else:
        forwards = [c for n in minibatch_samples(w, groups) for c in micro_batches(n, w.micro_batch)]
    reward = t.reward(b)
    # algorithm.shared_prefix / branch_tree: a step with fewer rows per group than G runs one forward of
    # the unit's nodes (a prefix: its group heads); the others run the unit's own forwards
    widths = w.rollout_widths()
    full = sum(t.rollout_step(c) for c in forwards)
    steps = sum(full if n == w.group_size else t.rollout_step(groups * n) for n in widths)
    calls = t.encode(groups) + steps + t.decode(b) + reward + reference_at_rollout(t, w, forwards)
    return max(MIN_UNIT_FRACTION * calls, calls * t.rollout_unit_factor + t.rollout_overhead_s), reward


def train_unit_time(
    t: CallTimes, w: Workload, groups: int, tsp_rank: int, tsp_degree: int, micro_batch: int
) -> float:
    """A train unit: one mini-batch's samples of ``groups`` groups (``groups x G / S``) x the rank's
    trained-step positions; per micro-batch and trained step one forward + backward (+ reference)
    of the samples training it -- every sample at once in fraction / window mode, where they all
    train the same steps; with random steps, one forward per distinct step of the micro-batch.
    ``train.old_logprob: recompute``: a no-grad forward of each forward's rows first."""
    step = (lambda n: t.train_step(n) + t.ref_forward(n)) if w.old_logprob else t.train_step
    b = groups * w.group_size // w.optimizer_steps
    positions = w.positions(tsp_rank, tsp_degree)
    calls = 0.0
    for size in micro_batches(b, micro_batch):
        if w.forward_process:  # diffusion_nft: per noise level the old policy's forward + forward/backward
            calls += positions * (
                t.ref_forward(size) + t.train_step(size) + (t.ref_forward(size) if w.kl else 0.0)
            )
        elif w.timestep_mode == "random":  # size x positions terms over k distinct steps (expected)
            choices = max(1, w.steps - 1)
            k = choices * (1 - (1 - min(1.0, positions / choices)) ** size)
            per = size * positions / k if k else 0.0
            calls += k * (step(per) + (t.ref_forward(per) if w.kl_on_trainer else 0.0)) if k else 0.0
        else:
            calls += positions * (step(size) + (t.ref_forward(size) if w.kl_on_trainer else 0.0))
    return max(MIN_UNIT_FRACTION * calls, calls * t.train_unit_factor + t.train_overhead_s)


def reference_at_rollout(t: CallTimes, w: Workload, forwards: list[float]) -> float:
    """``algorithm.kl_reference: rollout``: per trained step, one no-grad reference forward of each
    sampling forward's samples that train it -- a sampling forward's kernel (rollout efficiency, every
    guidance pass) at that batch; with random steps, the expected share of each forward's samples."""
    if not w.kl_at_rollout:
        return 0.0
    if w.timestep_mode == "random":
        choices = max(1, w.steps - 1)
        share = min(1.0, w.trained_steps / choices)
        return choices * sum(t.rollout_step(c * share) for c in forwards)
    return w.trained_steps * sum(t.rollout_step(c) for c in forwards)
