"""What a device holds, in bytes, as the runtime lays it out (docs/scaling.md, "Memory model").

Rollout worker (lean): the transformer in the model dtype, the LoRA weights as received (model
dtype), the text encoders, the VAE and a reward model with weights (half precision), one rollout
unit's live activations, trajectory and a decode tile. No optimizer, no reference copy.

Trainer rank, FSDP degree N (N = 1: replicated, DDP-style bucketed all-reduce):

- full fine-tuning: fp32 master parameters, fp32 gradients and AdamW's two fp32 moments, each
  1/N; the bf16 compute copy: replicated (N = 1) autocast keeps a cast of every weight for the
  backward, sharded FSDP2 all-gathers one block at a time (that block + the prefetched next);
  the KL reference (``kl_beta > 0``) a frozen copy in the model dtype, replicated (``Policy``
  deep-copies it; ``fully_shard`` shards only the trained transformer);
- LoRA: the frozen base in the model dtype (1/N under FSDP), fp32 LoRA masters, gradients and
  AdamW moments (1/N under FSDP); the gathered block as above.
- activations per sample: every block's saved tensors (activation checkpointing off), or each
  block's input plus one block recomputed (on). The trained step runs the guidance passes inside
  one autograd graph (``adapter.velocity`` computes the guided velocity from both passes), so both
  passes' activations are held at once. A micro-batch of ``mb`` samples is one forward.

No offloading: the runtime moves nothing to the host between phases, so the model has no offload
option. :class:`MemoryModel` lists every setting that fits; the cost model picks the cheapest in
time, :func:`resolve` picks a run's ``auto`` settings (the same model, a fixed preference order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from digenrl.planner.constants import ACT_BYTES_PER_TOKEN_HIDDEN, ADAMW_STATE_BYTES, FP32_BYTES, HALF_BYTES
from digenrl.planner.gpus import DEVICES
from digenrl.planner.params import ColocationCosts, CostParams
from digenrl.planner.workload import Workload

GiB = 2**30


@dataclass(frozen=True)
class DeviceSetup:
    """How a trainer (or colocated) device runs training: the decisions memory forces."""

    fits: bool
    micro_batch: int
    checkpointing: bool = False
    shard: int = 1  # FSDP degree over the trainer ranks
    need_bytes: float = 0.0
    have_bytes: float = 0.0
    parts: dict = field(default_factory=dict, compare=False)
    why: str = ""

    def notes(self) -> list[str]:
        out = []
        if self.checkpointing:
            out.append("act. ckpt")
        if self.shard > 1:
            out.append(f"FSDP x{self.shard}")
        return out


def gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def describe_parts(parts: dict) -> str:
    return ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v)


def shard_degrees(ranks: int) -> list[int]:
    """FSDP degrees a trainer pool of ``ranks`` can run: 1 and every divisor of ``ranks`` (HSDP
    when it is smaller than ``ranks``), smallest first."""
    return [d for d in range(1, ranks + 1) if ranks % d == 0]


class MemoryModel:
    """Bytes per device for one workload, under the memory fields of ``CostParams``."""

    def __init__(self, w: Workload, p: CostParams, col: ColocationCosts | None = None):
        self.w, self.p, self.col = w, p, col

    def have(self, device: str) -> float:
        return DEVICES[device].memory * self.p.usable_memory

    # -- what the parts weigh ------------------------------------------------------------

    def rollout_models(self) -> float:
        """Text encoder(s), VAE and a reward model with weights, in half precision."""
        sh = self.w.shape
        reward = self.p.model_reward_params if self.w.reward_kind == "model" else 0.0
        return HALF_BYTES * (sh.text_encoder_params + sh.vae_params + reward)

    def rollout_acts(self, groups: int) -> float:
        """A rollout unit of ``groups``: one block's live activations, the trajectory, a decode tile."""
        w, t = self.w, self.w.shape.tokens
        b = groups * w.group_size
        acts = b * (t.x + t.text) * w.params.hidden * self.p.infer_act_bytes
        trajectory = b * ((w.steps + 1) * t.latent_elements * FP32_BYTES
                          + w.passes * t.text * w.params.hidden * HALF_BYTES)
        decode = min(t.pixels, self.p.vae_tile_px) * self.p.vae_decode_bytes_per_px if w.shape.vae_params else 0.0
        return acts + trajectory + decode

    def act_bytes_per_block(self) -> float:
        """Bytes autograd saves for one sample through one block, one pass, checkpointing off."""
        w, t = self.w, self.w.shape.tokens
        per_token = ACT_BYTES_PER_TOKEN_HIDDEN.get(w.family, self.p.train_act_bytes)
        return (t.x + t.text) * w.params.hidden * per_token

    def block_input_bytes(self) -> float:
        """One block's input (image + text tokens in the model dtype): what checkpointing keeps."""
        w, t = self.w, self.w.shape.tokens
        return (t.x + t.text) * w.params.hidden * w.dtype_bytes

    def train_acts(self, mb: int, checkpointing: bool) -> float:
        """Activations of one training forward of ``mb`` samples, every guidance pass in the graph."""
        blocks = self.w.params.blocks
        if checkpointing:  # every block's input + one block recomputed in the backward
            per = self.block_input_bytes() * blocks + self.act_bytes_per_block()
        else:
            per = self.act_bytes_per_block() * blocks
        return self.w.passes * mb * per

    def gathered_block(self) -> float:
        """FSDP2's all-gathered compute copy: the running block and the prefetched next one."""
        return 2 * self.w.params.total / self.w.params.blocks * self.w.dtype_bytes

    def train_parts(self, shard: int, mb: int, ckpt: bool) -> dict:
        w = self.w
        total, lora = w.params.total, w.params.lora
        half = w.dtype_bytes < FP32_BYTES
        if w.lora:
            parts = {"frozen base": total * w.dtype_bytes / shard,
                     "fp32 masters": lora * FP32_BYTES / shard,
                     "fp32 grads": lora * FP32_BYTES / shard,
                     "AdamW state": lora * ADAMW_STATE_BYTES / shard,
                     "compute copy": self.gathered_block() if shard > 1 else 0.0,
                     "reference": 0.0}  # LoRA: the reference is the base with the adapters off
        else:
            parts = {"fp32 masters": total * FP32_BYTES / shard,
                     "fp32 grads": total * FP32_BYTES / shard,
                     "AdamW state": total * ADAMW_STATE_BYTES / shard,
                     "compute copy": (self.gathered_block() if shard > 1
                                      else total * w.dtype_bytes if half else 0.0),
                     "reference": total * w.dtype_bytes if w.kl else 0.0}
        parts["activations"] = self.train_acts(mb, ckpt)
        return parts

    def options(self, ranks: int, fsdp="auto", checkpointing="auto", micro_batch: int | None = None):
        """(micro-batch, checkpointing, shard) in order of preference: largest micro-batch, then
        replicated before sharded and sharding before checkpointing (checkpointing recomputes
        every forward; FSDP's collectives overlap the compute). ``fsdp``: auto | off | N;
        ``checkpointing``: auto | on | off; ``micro_batch``: only this one (else halving down to 1)."""
        ckpts = {"auto": (False, True), "on": (True,), "off": (False,)}[checkpointing]
        shards = shard_degrees(ranks) if fsdp == "auto" else [1] if fsdp == "off" else [fsdp]
        if micro_batch is not None:
            mbs = [micro_batch]
        else:
            mbs, mb = [], self.w.micro_batch
            while mb >= 1:
                mbs.append(mb)
                mb //= 2
        for mb in mbs:
            for ckpt in ckpts:
                for shard in shards:
                    yield mb, ckpt, shard

    # -- the setups ----------------------------------------------------------------------

    def rollout_parts(self, groups: int) -> dict:
        w = self.w
        return {"weights": w.params.total * w.dtype_bytes, "lora": w.params.lora * w.dtype_bytes if w.lora else 0,
                "rollout models": self.rollout_models(), "activations": self.rollout_acts(groups)}

    def rollout(self, device: str, groups: int) -> DeviceSetup:
        """Does a rollout worker of this type hold the model + rollout models + a unit of ``groups``?"""
        parts = self.rollout_parts(groups)
        need, have = sum(parts.values()), self.have(device)
        why = "" if need <= have else (f"a rollout unit of {groups} groups on {device} needs {gib(need)} "
                                       f"({describe_parts(parts)}) > {gib(have)} usable")
        return DeviceSetup(need <= have, self.w.micro_batch, need_bytes=need, have_bytes=have, parts=parts, why=why)

    def trainer_need(self, shard: int, mb: int, ckpt: bool, tag: bool = False, groups: int = 1) -> dict:
        """A trainer rank's parts; ``tag`` / colocated: it also samples units of ``groups`` (through
        the same sharded module, one gathered block at a time) and holds the rollout models."""
        parts = self.train_parts(shard, mb, ckpt)
        if tag:
            parts["rollout models"] = self.rollout_models()
            parts["rollout activations"] = max(0.0, self.rollout_acts(groups) - parts["activations"])
        return parts

    def setups(self, device: str, ranks: int, tag: bool, groups: int, **choices) -> tuple[list[DeviceSetup], DeviceSetup]:
        """(every setup that fits, in preference order; the last one tried, with why it does not)."""
        have = self.have(device)
        fits, last = [], None
        for mb, ckpt, shard in self.options(ranks, **choices):
            parts = self.trainer_need(shard, mb, ckpt, tag, groups)
            need = sum(parts.values())
            last = (need, parts, mb, ckpt, shard)
            if need <= have:
                fits.append(DeviceSetup(True, mb, ckpt, shard, need, have, parts))
        need, parts, mb, ckpt, shard = last
        role = "a colocated device" if tag else "a trainer"
        miss = DeviceSetup(False, mb, ckpt, shard, need, have, parts,
                           why=f"{role} on {device} needs {gib(need)} ({describe_parts(parts)}) > {gib(have)} "
                               f"usable even at micro-batch {mb}" + (f", FSDP x{shard}" if shard > 1 else "")
                               + (", activation checkpointing" if ckpt else ""))
        return fits, miss

    def trainer(self, device: str, ranks: int, tag: bool, groups: int) -> tuple[list[DeviceSetup], DeviceSetup]:
        """(every setup of a trainer rank that fits, the last one tried with why it does not);
        ``tag``: the rank also rolls out units of ``groups``."""
        return self.setups(device, ranks, tag, groups)

    def colocated(self, device: str, ranks: int, groups: int) -> tuple[list[DeviceSetup], DeviceSetup]:
        """A colocated device holds the training and the sampling state at once (no offloading)."""
        return self.setups(device, ranks, True, groups)
