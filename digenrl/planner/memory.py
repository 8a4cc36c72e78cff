"""What a device holds, in bytes: a rollout worker, a trainer rank, a colocated device.

Weights, LoRA / optimizer states (AdamW: fp32 weight, grad and two moments per trained parameter),
activations per training sample (with activation checkpointing or FSDP sharding when needed), the
rollout side's text encoder / VAE / reward model. :class:`MemoryModel` lists every setup that fits
(micro-batch, checkpointing, FSDP degree, offloading); the cost model picks the cheapest in time.
A device where nothing fits gets a :class:`DeviceSetup` with ``fits=False`` and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from digenrl.planner.constants import FP32_BYTES, FSDP_DEGREES, HALF_BYTES
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
    offload: bool = False  # colocated: the other phase's state moves to the host
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
        if self.offload:
            out.append("offload")
        return out


def gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def describe_parts(parts: dict) -> str:
    return ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v)


class MemoryModel:
    """Bytes per device for one workload, under the memory fields of ``CostParams`` and the
    colocation offload policy."""

    def __init__(self, w: Workload, p: CostParams, col: ColocationCosts):
        self.w, self.p, self.col = w, p, col

    def have(self, device: str) -> float:
        return DEVICES[device].memory * self.p.usable_memory

    # -- what the parts weigh ------------------------------------------------------------

    def rollout_models(self) -> float:
        """Text encoder, VAE and a reward model with weights, in half precision."""
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

    def train_acts(self, mb: int, checkpointing: bool) -> float:
        w, t = self.w, self.w.shape.tokens
        per_block = (t.x + t.text) * w.params.hidden
        if checkpointing:
            per = per_block * (self.p.ckpt_act_bytes * w.params.blocks + self.p.train_act_bytes)
        else:
            per = per_block * self.p.train_act_bytes * w.params.blocks
        return w.passes * mb * per

    def train_parts(self, shard: int, mb: int, ckpt: bool) -> dict:
        w = self.w
        weights = w.params.total * w.dtype_bytes
        state = w.trained_params * self.p.trained_state_bytes
        return {
            "weights": weights / shard,
            "trained state": state if w.lora else state / shard,
            "reference": weights / shard if (w.kl and not w.lora) else 0.0,
            "activations": self.train_acts(mb, ckpt),
        }

    def options(self, ranks: int):
        """(micro-batch, checkpointing, shard) in order of preference: cheapest first."""
        p = self.p
        ckpts = {"auto": (False, True), "on": (True,), "off": (False,)}[p.gradient_checkpointing]
        shards = [1] + ([s for s in FSDP_DEGREES if s <= ranks] + ([ranks] if ranks > 1 else [])
                        if p.allow_fsdp else [])
        mbs, mb = [], self.w.micro_batch
        while mb >= 1:
            mbs.append(mb)
            mb //= 2
        for mb in mbs:
            for shard in dict.fromkeys(shards):
                for ckpt in ckpts:
                    yield mb, ckpt, shard

    # -- the setups ----------------------------------------------------------------------

    def rollout(self, device: str, groups: int) -> DeviceSetup:
        """Does a rollout worker of this type hold the model + rollout models + a unit of ``groups``?"""
        w = self.w
        parts = {"weights": w.params.total * w.dtype_bytes, "lora": w.params.lora * FP32_BYTES if w.lora else 0,
                 "rollout models": self.rollout_models(), "activations": self.rollout_acts(groups)}
        need, have = sum(parts.values()), self.have(device)
        why = "" if need <= have else (f"a rollout unit of {groups} groups on {device} needs {gib(need)} "
                                       f"({describe_parts(parts)}) > {gib(have)} usable")
        return DeviceSetup(need <= have, w.micro_batch, need_bytes=need, have_bytes=have, parts=parts, why=why)

    def trainer(self, device: str, ranks: int, tag: bool, groups: int) -> tuple[list[DeviceSetup], DeviceSetup]:
        """(every setup of a trainer rank that fits, the last one tried with why it does not);
        ``tag``: the rank also rolls out units of ``groups``."""
        have = self.have(device)
        fits, last = [], None
        for mb, ckpt, shard in self.options(ranks):
            parts = self.train_parts(shard, mb, ckpt)
            if tag:  # TAG: the rank also samples, with gathered weights and the rollout models
                parts["rollout models"] = self.rollout_models()
                parts["rollout activations"] = max(0.0, self.rollout_acts(groups) - parts["activations"])
                if shard > 1:
                    parts["gathered weights"] = parts["weights"] * (shard - 1)
            need = sum(parts.values())
            last = (need, parts, mb, ckpt, shard)
            if need <= have:
                fits.append(DeviceSetup(True, mb, ckpt, shard, False, need, have, parts))
        need, parts, mb, ckpt, shard = last
        miss = DeviceSetup(False, mb, ckpt, shard, False, need, have, parts,
                           why=f"a trainer on {device} needs {gib(need)} ({describe_parts(parts)}) > {gib(have)} "
                               f"usable even at micro-batch {mb}" + (f", FSDP x{shard}" if shard > 1 else "")
                               + (", activation checkpointing" if ckpt else ""))
        return fits, miss

    def colocated(self, device: str, ranks: int, groups: int) -> tuple[list[DeviceSetup], DeviceSetup]:
        """(every setup of a colocated device that fits, the last one tried with why it does not):
        training and sampling state at once, or offloading between the phases."""
        have = self.have(device)
        offloads = {"auto": (False, True), "always": (True,), "never": (False,)}[self.col.offload]
        fits, last = [], None
        for mb, ckpt, shard in self.options(ranks):
            train = self.train_parts(shard, mb, ckpt)
            roll_models = self.rollout_models()
            gathered = train["weights"] * (shard - 1) if shard > 1 else 0.0
            for offload in offloads:
                if offload:  # each phase holds only its own state
                    need_train = sum(train.values())
                    need_roll = train["weights"] + gathered + roll_models + self.rollout_acts(groups) + (
                        self.w.params.lora * FP32_BYTES if self.w.lora else 0)
                    need = max(need_train, need_roll)
                else:
                    need = sum(train.values()) + roll_models + gathered + max(
                        0.0, self.rollout_acts(groups) - train["activations"])
                parts = dict(train, **{"rollout models": roll_models, "gathered weights": gathered})
                last = (need, parts, mb, ckpt, shard, offload)
                if need <= have:
                    fits.append(DeviceSetup(True, mb, ckpt, shard, offload, need, have, parts))
                    break  # offloading only when it is needed
        need, parts, mb, ckpt, shard, offload = last
        miss = DeviceSetup(False, mb, ckpt, shard, offload, need, have, parts,
                           why=f"a colocated device {device} needs {gib(need)} ({describe_parts(parts)}) > "
                               f"{gib(have)} usable even with offloading, micro-batch {mb}"
                               + (f", FSDP x{shard}" if shard > 1 else ""))
        return fits, miss
