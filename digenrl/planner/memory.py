"""What a device holds, in bytes, as the runtime lays it out (docs/scaling.md, "Memory model").

Details: docs/modules.md, `digenrl.planner.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from digenrl.placement.devices import DEVICES
from digenrl.planner.constants import ACT_BYTES_PER_TOKEN_HIDDEN, ADAMW_STATE_BYTES, FP32_BYTES, HALF_BYTES
from digenrl.planner.params import ColocationCosts, CostParams
from digenrl.planner.workload import Workload

GiB = 2**30


@dataclass(frozen=True)
class DeviceSetup:
    """How a trainer (or colocated) device runs training: the decisions memory forces."""

    fits: bool
    micro_batch: int
    checkpointing: bool = False
    shard: int = 1  # FSDP degree over the trainer devices (train.fsdp; with sp, SP groups inside it)
    sp: int = 1  # devices per worker (sequence parallelism); every figure is per device
    cfg_batched: bool = True  # two-pass CFG as one forward of 2B (False: one pass at a time)
    need_bytes: float = 0.0
    have_bytes: float = 0.0
    parts: dict = field(default_factory=dict, compare=False)
    why: str = ""
    rollout_batch: int | None = None  # a rollout-only worker: samples per forward (None: the trainer's)
    pair_batch: int | None = None  # train.pair_batch: rows per timestep-pair forward (None: per step)

    def notes(self) -> list[str]:
        out = []
        if self.checkpointing:
            out.append("act. ckpt")
        if self.shard > 1:
            out.append(f"FSDP x{self.shard}")
        if self.sp > 1:
            out.append(f"SP x{self.sp}")
        if not self.cfg_batched:
            out.append("CFG seq.")
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
        self.workload, self.params, self.colocation = w, p, col

    def have(self, device: str) -> float:
        return DEVICES[device].memory * self.params.usable_memory

    # -- what the parts weigh ------------------------------------------------------------

    def rollout_models(self) -> float:
        """Text encoder(s), VAE and a reward model with weights (not a remote judge), in half precision;
        with ``model.offload_text_encoders`` the encoders live on the CPU (on the device only for the
        encode, before a unit's denoising activations exist: not counted at the peak)."""
        sh = self.workload.shape
        reward = self.params.model_reward_params if self.workload.reward_weights else 0.0  # (a judge: none)
        text = 0.0 if self.workload.text_offload else sh.text_encoder_params
        return HALF_BYTES * (text + sh.vae_params + reward)

    def cfg_modes(self, choice: str = "auto") -> tuple[bool, ...]:
        """Two-pass CFG modes to try, batched first (``choice``: auto | batched | sequential); one
        pass per step has nothing to choose."""
        if self.workload.passes == 1:
            return (True,)
        return {"auto": (True, False), "batched": (True,), "sequential": (False,)}[choice]

    def pass_tokens(self, sp: int = 1) -> float:
        """Tokens one device holds of one sample through a block: 1/sp of the image / video tokens
        (Ulysses), all the text tokens."""
        t = self.workload.shape.tokens
        return t.x / sp + t.text

    def held_passes(self, cfg_batched: bool) -> int:
        """Guidance passes whose activations are live at once."""
        return self.workload.passes if cfg_batched else 1

    def rollout_acts(
        self, groups: float, sp: int = 1, cfg_batched: bool = True, batch: int | None = None
    ) -> float:
        """A rollout unit of ``groups``: one block's live activations of a forward (of ``batch``
        samples, ``engine.rollout_batch``; None: the whole unit at once, the bound for forwards in
        the trainer's batches), the unit's trajectory, a decode tile."""
        w, t = self.workload, self.workload.shape.tokens
        b = groups * w.group_size
        acts = (
            self.held_passes(cfg_batched)
            * (min(batch, b) if batch else b)
            * self.pass_tokens(sp)
            * w.params.hidden
            * self.params.infer_act_bytes
        )
        trajectory = self.trajectory_bytes(b) + b * w.passes * t.text * w.params.hidden * HALF_BYTES
        return acts + trajectory + self.decode_bytes()

    def trajectory_bytes(self, samples: float) -> float:
        """What ``algorithms.sde.sample`` writes for ``samples`` samples, into buffers allocated once
        (fp32): the latents x_0..x_N, each step's noise and each step's log-probability."""
        w = self.workload
        return samples * ((2 * w.steps + 1) * w.shape.tokens.latent_elements + w.steps) * FP32_BYTES

    def decode_bytes(self) -> float:
        """The VAE decode, one sample at a time: a tile of it when tiled (``sampling.vae_tiling``)."""
        w = self.workload
        if not w.shape.vae_params:
            return 0.0
        px = w.shape.tokens.pixels
        return (min(px, self.params.vae_tile_px) if w.vae_tiled else px) * self.params.vae_decode_bytes_per_px

    def act_bytes_per_block(self, sp: int = 1) -> float:
        """Bytes autograd saves for one sample through one block, one pass, checkpointing off, per device."""
        per_token = ACT_BYTES_PER_TOKEN_HIDDEN.get(self.workload.family, self.params.train_act_bytes)
        return self.pass_tokens(sp) * self.workload.params.hidden * per_token

    def block_input_bytes(self, sp: int = 1) -> float:
        """One block's input (image + text tokens in the model dtype): what checkpointing keeps."""
        return self.pass_tokens(sp) * self.workload.params.hidden * self.workload.dtype_bytes

    def train_acts(self, mb: int, checkpointing: bool, sp: int = 1, cfg_batched: bool = True) -> float:
        """Activations of one training forward of ``mb`` samples: both guidance passes in the graph
        (batched) or one at a time (sequential)."""
        blocks = self.workload.params.blocks
        if checkpointing:  # every block's input + one block recomputed in the backward
            per = self.block_input_bytes(sp) * blocks + self.act_bytes_per_block(sp)
        else:
            per = self.act_bytes_per_block(sp) * blocks
        return self.held_passes(cfg_batched) * mb * per

    def gathered_block(self) -> float:
        """FSDP2's all-gathered compute copy: the running block and the prefetched next one (the two
        largest), and the root's own parameters (``ParamCounts.gathered``; else two average blocks)."""
        p = self.workload.params
        whole = p.gathered or 2 * p.total / (p.experts * p.blocks)
        return whole * self.workload.dtype_bytes

    def train_parts(self, shard: int, mb: int, ckpt: bool, sp: int = 1, cfg_batched: bool = True) -> dict:
        w = self.workload
        total, lora = w.params.total, w.params.lora
        half = w.dtype_bytes < FP32_BYTES
        if w.lora:
            parts = {
                "frozen base": total * w.dtype_bytes / shard,
                "fp32 masters": lora * FP32_BYTES / shard,
                "fp32 grads": lora * FP32_BYTES / shard,
                "AdamW state": lora * ADAMW_STATE_BYTES / shard,
                "compute copy": self.gathered_block() if shard > 1 else 0.0,
                "reference": 0.0,
            }  # LoRA: the reference is the base with the adapters off
        else:  # a frozen expert (Wan2.2 A14B, model.train_experts) keeps its dtype and no optimizer state
            trained = w.trained_params
            parts = {
                "fp32 masters": trained * FP32_BYTES / shard,
                "fp32 grads": trained * FP32_BYTES / shard,
                "AdamW state": trained * ADAMW_STATE_BYTES / shard,
                "frozen expert": w.params.frozen * w.dtype_bytes / shard,
                "compute copy": (
                    self.gathered_block() if shard > 1 else trained * w.dtype_bytes if half else 0.0
                ),
                "reference": total * w.dtype_bytes / shard if w.kl else 0.0,
            }
        if w.ema:  # train.ema: an fp32 average of the trained weights, sharded like them
            parts["EMA"] = w.trained_params * FP32_BYTES / shard
        if w.forward_process:  # diffusion_nft: the old policy, an fp32 EMA of the trained weights, sharded
            parts["old policy"] = w.trained_params * FP32_BYTES / shard
        parts["activations"] = self.train_acts(mb, ckpt, sp, cfg_batched)
        return parts

    def options(
        self,
        ranks: int,
        fsdp="auto",
        checkpointing="auto",
        micro_batch: int | None = None,
        cfg="auto",
        sp: int = 1,
    ):
        """(micro-batch, checkpointing, CFG batched, shard) in order of preference: largest micro-batch,
        then replicated before sharded, sharding before sequential CFG (one more forward of one pass)
        and that before checkpointing (recomputes every forward; FSDP's collectives overlap the
        compute). ``fsdp``: auto | off | N; ``checkpointing``: auto | on | off; ``cfg``: auto | batched
        | sequential; ``micro_batch``: only this one (else halving down to 1)."""
        ckpts = {"auto": (False, True), "on": (True,), "off": (False,)}[checkpointing]
        shards = shard_degrees(ranks) if fsdp == "auto" else [1] if fsdp == "off" else [fsdp]
        if sp > 1 and fsdp == "auto":  # a shard group holds whole sequence-parallel groups (HSDP when
            shards = [d for d in shards if d == 1 or d % sp == 0]  # smaller: settings.fsdp_refusal)
        if micro_batch is not None:
            mbs = [micro_batch]
        else:
            mbs, mb = [], self.workload.micro_batch
            while mb >= 1:
                mbs.append(mb)
                mb //= 2
        for mb in mbs:
            for ckpt in ckpts:
                for batched in self.cfg_modes(cfg):
                    for shard in shards:
                        yield mb, ckpt, batched, shard

    # -- the setups ----------------------------------------------------------------------

    def rollout_parts(
        self, groups: float, sp: int = 1, cfg_batched: bool = True, batch: int | None = None
    ) -> dict:
        w = self.workload
        return {
            "weights": w.params.total * w.dtype_bytes,
            "lora": w.params.lora * w.dtype_bytes if w.lora else 0,
            "rollout models": self.rollout_models(),
            "activations": self.rollout_acts(groups, sp, cfg_batched, batch),
        }

    def rollout_batch(self, device: str, groups: float, sp: int = 1, cfg: str = "auto") -> int:
        """``engine.rollout_batch: auto``: the largest samples per forward (at most the unit's) with
        which a rollout worker of this type holds a unit of ``groups`` (1 when none does: the
        memory check then refuses the unit)."""
        samples = max(1, int(groups * self.workload.group_size))
        fitting = [b for b in range(samples, 0, -1) if self.rollout(device, groups, sp, cfg, b).fits]
        return fitting[0] if fitting else 1

    def rollout(
        self, device: str, groups: float, sp: int = 1, cfg: str = "auto", batch: int | None = None
    ) -> DeviceSetup:
        """Does a rollout worker of this type (each of its ``sp`` devices) hold the model + rollout
        models + a unit of ``groups``, forwarding ``batch`` samples at a time (None: the trainer's
        batches, bounded by the whole unit)? CFG batched when it fits (``cfg`` auto), else sequential."""
        have = self.have(device)
        for batched in self.cfg_modes(cfg):
            parts = self.rollout_parts(groups, sp, batched, batch)
            need = sum(parts.values())
            if need <= have:
                break
        why = (
            ""
            if need <= have
            else (
                f"a rollout unit of {groups:g} groups on {device}"
                + (f" (SP x{sp})" if sp > 1 else "")
                + f" needs {gib(need)} ({describe_parts(parts)}) > {gib(have)} usable"
            )
        )
        return DeviceSetup(
            need <= have,
            self.workload.micro_batch,
            sp=sp,
            rollout_batch=batch,
            cfg_batched=batched,
            need_bytes=need,
            have_bytes=have,
            parts=parts,
            why=why,
        )

    def trainer_need(
        self,
        shard: int,
        mb: int,
        ckpt: bool,
        tag: bool = False,
        groups: float = 1,
        sp: int = 1,
        cfg_batched: bool = True,
    ) -> dict:
        """A trainer rank's parts (per device of its ``sp``); ``tag`` / colocated: it also samples units
        of ``groups`` (through the same sharded module, one gathered block at a time) and holds the
        rollout models."""
        parts = self.train_parts(shard, mb, ckpt, sp, cfg_batched)
        if tag:
            parts["rollout models"] = self.rollout_models()
            parts["rollout activations"] = max(
                0.0, self.rollout_acts(groups, sp, cfg_batched) - parts["activations"]
            )
        return parts

    def setups(
        self, device: str, ranks: int, tag: bool, groups: float, sp: int = 1, **choices
    ) -> tuple[list[DeviceSetup], DeviceSetup]:
        """(every setup that fits, in preference order; the last one tried, with why it does not).
        ``ranks``: trainer ranks (each of ``sp`` devices); the sharding degrees count devices (the
        runtime's ``train.fsdp``: FSDP over all ``ranks x sp`` devices, sequence parallelism inside)."""
        have = self.have(device)
        fits, last = [], None
        for mb, ckpt, batched, shard in self.options(ranks * sp, sp=sp, **choices):
            parts = self.trainer_need(shard, mb, ckpt, tag, groups, sp, batched)
            need = sum(parts.values())
            last = (need, parts, mb, ckpt, shard, batched)
            if need <= have:
                fits.append(DeviceSetup(True, mb, ckpt, shard, sp, batched, need, have, parts))
        need, parts, mb, ckpt, shard, batched = last
        role = "a colocated device" if tag else "a trainer"
        miss = DeviceSetup(
            False,
            mb,
            ckpt,
            shard,
            sp,
            batched,
            need,
            have,
            parts,
            why=f"{role} on {device} needs {gib(need)} ({describe_parts(parts)}) > {gib(have)} "
            f"usable even at micro-batch {mb}"
            + (f", FSDP x{shard}" if shard > 1 else "")
            + (f", SP x{sp}" if sp > 1 else "")
            + (", activation checkpointing" if ckpt else "")
            + ("" if batched or self.workload.passes == 1 else ", sequential CFG"),
        )
        return fits, miss

    def trainer(
        self, device: str, ranks: int, tag: bool, groups: float, sp: int = 1
    ) -> tuple[list[DeviceSetup], DeviceSetup]:
        """(every setup of a trainer rank that fits, the last one tried with why it does not);
        ``tag``: the rank also rolls out units of ``groups`` (TAG: its rollout beside its training state)."""
        fits, miss = self.setups(device, ranks, tag, groups, sp)
        if tag:
            miss = replace(miss, why=miss.why.replace("a colocated device", "a TAG trainer rank", 1))
        return fits, miss

    def colocated(
        self, device: str, ranks: int, groups: float, sp: int = 1
    ) -> tuple[list[DeviceSetup], DeviceSetup]:
        """A colocated device holds the training and the sampling state at once (no offloading)."""
        return self.setups(device, ranks, True, groups, sp)
