"""The peers as they run: each published system's iteration, phase by phase, with its structural costs.

DigenRL's own baselines (``search.BASELINES``: the best colocated arrangement of OUR engine, and
``separate_async``) show what the engine's knobs add. These models show what a user of each peer
pays today. They run no scheduler: each peer is synchronous phase after phase (veRL-Omni's
``separate_async`` overlaps one rollout with one update), so an iteration is a sum (or max) of
phases, each computed from the same per-call times as DigenRL's units (:mod:`call_times`: the same
kernel efficiencies, the same FLOP formulas, the same datasheet bandwidths). Every structural term
names the peer's file that shows it (:data:`SOURCES`; docs/scaling.md "The peers as they run").

- ``verl_omni_colocated``: on every GPU, one after another: generation on a rollout server
  (vLLM-Omni) sharing the GPUs, woken before and slept after; the reward model on the same GPUs;
  an old-log-prob recompute pass over every trained step; the actor update (FSDP, actor parameters
  and optimizer offloaded to host memory between phases, gradient checkpointing); weights pushed
  into the server every iteration.
- ``verl_omni_separate_async``: a rollout pool (server + reward) and a trainer pool, one step off:
  ``max(rollout, train) + weight push``; the best split of the cluster.
- ``dancegrpo``: every GPU samples its prompt's G images at batch 1 through the FULL_SHARD FSDP
  training module (fp32 parameters: an fp32 all-gather every denoising forward), scores them on the
  same GPU, and trains each sample's steps at batch 1 (an all-gather in the forward, one in the
  backward, a reduce-scatter of fp32 gradients every backward).
- ``flow_grpo``: DDP (a full replica per GPU), sampling on the training model itself in the train
  batch, rewards on the same GPU, gradients all-reduced once per optimizer step.

Two numbers of veRL-Omni's step are inputs read off its published breakdown, not predictions: the
reward judge's seconds per image (a VLM served by vLLM, which DigenRL does not model) and the fixed
part of its weight push (:data:`VERL_OMNI`; ``benchmarks/peer_calibration.py`` fits them with the
kernel efficiencies and says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from digenrl.placement.devices import DEVICES
from digenrl.planner.call_times import AnalyticTimes, CallTimes, ProfiledTimes
from digenrl.planner.constants import ADAMW_STATE_BYTES, FP32_BYTES, OPTIMIZER_FIXED_S, OPTIMIZER_STATE_PASSES

#: (what, repository, path) for every structural term of each peer model
SOURCES: dict[str, list[tuple[str, str, str]]] = {
    "verl_omni_colocated": [
        (
            "phases gen -> reward -> old_log_prob -> update_actor -> update_weights, one after another; "
            "the rollout server slept after generation (sleep_replicas) and woken for the next; the "
            "old_log_prob recompute pass; weights pushed every iteration (checkpoint_manager.update_weights)",
            "verl-project/verl-omni",
            "verl_omni/trainer/diffusion/ray_diffusion_trainer.py",
        ),
        (
            "actor parameters and optimizer offloaded (fsdp_config.param_offload / optimizer_offload True); "
            "reward model on the same 4 GPUs (reward.reward_model.enable, TP 4); server batch "
            "max_num_seqs 32; ppo_micro_batch_size_per_gpu 16; log_prob_micro_batch_size_per_gpu 32; "
            "2 mini-batches (ppo_mini_batch_size 16 of 32 prompts); sde_window_size 2",
            "verl-project/verl-omni",
            "examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh",
        ),
        (
            "gradient checkpointing on (enable_gradient_checkpointing: True)",
            "verl-project/verl-omni",
            "verl_omni/trainer/config/diffusion/model/diffusion_model.yaml",
        ),
        (
            "10 sampling steps at 512 x 512 (pipeline defaults)",
            "verl-project/verl-omni",
            "verl_omni/trainer/config/diffusion/rollout/diffusion_rollout.yaml",
        ),
    ],
    "verl_omni_separate_async": [
        (
            "a standalone rollout pool one step off the trainer; weights pushed every iteration",
            "verl-project/verl-omni",
            "verl_omni/trainer/diffusion/v1/trainer_separate_async.py",
        ),
    ],
    "dancegrpo": [
        (
            "sampling at batch 1 (sample_reference_model: batch_size = 1) through the FSDP training "
            "module; the reward model (HPSv2 / PickScore) scored on the same GPU per image; training one "
            "sample and one step per backward, no no_sync (a reduce-scatter every backward); fp32 master "
            "weights (torch_dtype float32)",
            "XueZeyue/DanceGRPO",
            "fastvideo/train_grpo_flux.py",
        ),
        (
            "FULL_SHARD with MixedPrecision(param_dtype=fp32): the all-gather moves fp32 parameters; "
            "forward_prefetch / backward_prefetch",
            "XueZeyue/DanceGRPO",
            "fastvideo/utils/fsdp_util.py",
        ),
        (
            "16 GPUs, 1 prompt x 12 images each, 720 px, 16 steps, 60% of the steps trained, "
            "gradient accumulation 4, gradient checkpointing",
            "XueZeyue/DanceGRPO",
            "scripts/finetune/finetune_flux_grpo.sh",
        ),
    ],
    "flow_grpo": [
        (
            "accelerate (DDP): sampling with pipeline_with_logprob on the training transformer itself; "
            "rewards in a thread pool (executor.submit(reward_fn, ...)) on the same GPU; gradients "
            "synchronised once per accumulation (accelerator.accumulate)",
            "yifan123/flow_grpo",
            "scripts/train_flux.py",
        ),
    ],
}

NAMES = tuple(SOURCES)


@dataclass(frozen=True)
class VerlOmniSettings:
    """veRL-Omni's knobs as its published run sets them (run_qwen_image_ocr_lora.sh), and the two
    numbers read off its published breakdown (benchmarks/peer_calibration.py)."""

    server_batch: int = 32  # max_num_seqs: step-wise continuous batching of the rollout server
    micro_batch: int = 16  # ppo_micro_batch_size_per_gpu
    log_prob_micro_batch: int = 32  # log_prob_micro_batch_size_per_gpu
    checkpointing: bool = True  # enable_gradient_checkpointing
    param_offload: bool = True
    optimizer_offload: bool = True
    # fixed part of update_weights beyond the modelled moves (wake, layered summon, server load):
    # 10.2 s published - the moves predicted on 4xH800 (peer_calibration.py prints the fit)
    push_latency_s: float = 9.8


VERL_OMNI = VerlOmniSettings()


@dataclass
class PeerRun:
    """One peer's predicted iteration: seconds per phase (in order), per iteration."""

    name: str
    where: str  # e.g. "4xH800" or "R 1xH800 / T 3xH800"
    phases: dict[str, float] = field(default_factory=dict)
    iteration_s: float = 0.0
    samples: int = 0
    devices: int = 0
    why_not: str = ""  # non-empty: the peer cannot run this model on this cluster

    @property
    def fits(self) -> bool:
        return not self.why_not

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.iteration_s if self.iteration_s else 0.0

    @property
    def per_device_s(self) -> float:
        return self.samples_per_s / self.devices if self.devices else 0.0


# ------------------------------------------------------------------------------- helpers


def _times(cost, device: str, checkpointing: bool = False, cfg_batched: bool = True) -> CallTimes:
    """Per-call times of one unsharded device (a profile's when it measured this type)."""
    if cost.profiled(device):
        return ProfiledTimes(cost.profile)
    return AnalyticTimes(
        cost.workload, DEVICES[device], cost.params, checkpointing=checkpointing, cfg_batched=cfg_batched
    )


def _host_s(cost, device: str, nbytes: float) -> float:
    """A pinned host <-> device copy of ``nbytes``."""
    return nbytes / (DEVICES[device].host_bw * cost.params.host_bw_efficiency)


def _collective_s(cost, device: str, ranks: int, nbytes: float) -> float:
    """An all-gather (or reduce-scatter) of ``nbytes`` over ``ranks`` devices: (r-1)/r of it per device."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / cost.link_bw(device, ranks)


def _unhidden(cost, collective: float, compute: float) -> float:
    """What a prefetched collective adds to a call: the share ``fsdp_overlap`` of it hides behind
    the call's compute, never more than the compute itself."""
    return collective - min(cost.params.fsdp_overlap * collective, compute)


def _batches(samples: float, batch: int) -> tuple[int, float]:
    """``samples`` in the fewest calls of at most ``batch``: (calls, samples per call)."""
    if samples <= 0:
        return 0, 0.0
    calls = max(1, math.ceil(samples / batch - 1e-9))
    return calls, samples / calls


def _one_type(cluster) -> tuple[str, int] | None:
    """(device type, count) of a cluster of one type; None for a mixed cluster."""
    devices = cluster.devices
    return next(iter(devices.items())) if len(devices) == 1 else None


def _weights_fit(cost, device: str, nbytes: float) -> bool:
    return nbytes <= DEVICES[device].memory * cost.params.usable_memory


# ------------------------------------------------------------------------- veRL-Omni


def verl_omni_phases(cost, device: str, n: int, s: VerlOmniSettings = VERL_OMNI) -> dict[str, float]:
    """Seconds of each phase of one colocated veRL-Omni step on ``n`` devices of ``device``."""
    w, p = cost.workload, cost.params
    per = w.samples / n  # samples each GPU generates, scores and trains
    T, S = w.trained_steps, w.optimizer_steps
    roll = _times(cost, device)  # the server: an unsharded bf16 copy (rollout TP 1)
    train = _times(cost, device, checkpointing=s.checkpointing)
    weights = w.params.total * w.dtype_bytes
    actor_shard = weights / n  # FSDP-sharded actor parameters on each GPU

    calls, b = _batches(per, s.server_batch)
    wake = _host_s(cost, device, weights)  # the slept server's weights back from host memory
    generation = w.steps * calls * roll.rollout_step(b) + roll.encode(w.prompts / n) + roll.decode(per) + wake

    reward = roll.reward(per)  # the judge on the same GPUs (p.model_reward_s per image)

    onload = _host_s(cost, device, actor_shard) if s.param_offload else 0.0
    calls, b = _batches(per, s.log_prob_micro_batch)
    gather = _collective_s(cost, device, n, weights)  # FSDP all-gather of the actor per forward
    forward = train.ref_forward(b)
    old_log_prob = onload + T * calls * (forward + _unhidden(cost, gather, forward))

    calls, b = _batches(per / S, s.micro_batch)
    step_compute = train.train_step(b)
    per_call = step_compute + _unhidden(cost, 2 * gather, step_compute)  # gathers in forward and backward
    grads = 2 * _collective_s(cost, device, n, w.trained_params * FP32_BYTES)  # reduce-scatter + all-gather
    opt_state = w.trained_params * ADAMW_STATE_BYTES / (n if not w.lora else 1)
    opt_moves = 2 * _host_s(cost, device, opt_state) if s.optimizer_offload else 0.0
    update_actor = S * (T * calls * per_call + grads + train.optimizer()) + opt_moves

    push = _collective_s(cost, device, n, w.sync_bytes) + w.sync_bytes / (
        DEVICES[device].mem_bw * p.mem_bw_efficiency
    )
    offload = _host_s(cost, device, actor_shard) if s.param_offload else 0.0
    update_weights = onload + push + offload + s.push_latency_s
    return {
        "generation": generation,
        "reward": reward,
        "old_log_prob": old_log_prob,
        "update_actor": update_actor,
        "update_weights": update_weights,
    }


def verl_omni_colocated(cost, cluster, s: VerlOmniSettings = VERL_OMNI) -> PeerRun:
    one = _one_type(cluster)
    if one is None:
        return PeerRun("verl_omni_colocated", cluster.describe(), why_not="one GPU type per resource pool")
    device, n = one
    w = cost.workload
    run = PeerRun("verl_omni_colocated", f"{n}x{device}", samples=w.samples, devices=n)
    if not _weights_fit(cost, device, w.params.total * w.dtype_bytes):
        run.why_not = "the server's bf16 copy of the weights does not fit one GPU (rollout TP 1)"
        return run
    run.phases = verl_omni_phases(cost, device, n, s)
    run.iteration_s = sum(run.phases.values())
    return run


def verl_omni_separate_async(cost, cluster, s: VerlOmniSettings = VERL_OMNI) -> PeerRun:
    """The best split: rollout pool of r GPUs (server awake, reward on it), trainer pool of n - r
    (no offload needed), one step off: ``max(rollout, train) + weight push``."""
    one = _one_type(cluster)
    if one is None or one[1] < 2:
        return PeerRun("verl_omni_separate_async", cluster.describe(), why_not="needs 2+ GPUs of one type")
    device, n = one
    w = cost.workload
    best = PeerRun("verl_omni_separate_async", f"{n}x{device}", why_not="does not fit")
    if not _weights_fit(cost, device, w.params.total * w.dtype_bytes):
        return best
    quiet = VerlOmniSettings(**{**s.__dict__, "param_offload": False, "optimizer_offload": False})
    for r in range(1, n):
        roll = verl_omni_phases(cost, device, r, quiet)
        train = verl_omni_phases(cost, device, n - r, quiet)
        wake = _host_s(cost, device, w.params.total * w.dtype_bytes)  # a dedicated server stays awake
        rollout_side = roll["generation"] - wake + roll["reward"]
        train_side = train["old_log_prob"] + train["update_actor"]
        wire = w.sync_bytes / (cost.cluster.interconnect.bandwidth_gb_s * 1e9)  # trainer -> server pool
        push = wire + s.push_latency_s
        run = PeerRun(
            "verl_omni_separate_async",
            f"R {r}x{device} / T {n - r}x{device}",
            {"rollout + reward (overlapped)": rollout_side, "train (overlapped)": train_side, "push": push},
            max(rollout_side, train_side) + push,
            w.samples,
            n,
        )
        if not best.fits or run.iteration_s < best.iteration_s:
            best = run
    return best


# -------------------------------------------------------------------------- DanceGRPO


def dancegrpo(cost, cluster) -> PeerRun:
    """Every GPU: its prompts' samples at batch 1 through the FULL_SHARD fp32 FSDP module (an fp32
    all-gather per forward), decode + reward on the GPU, then every sample's trained steps at batch 1
    (gather in forward and backward, fp32 reduce-scatter every backward), ``optimizer_steps`` steps."""
    one = _one_type(cluster)
    if one is None:
        return PeerRun("dancegrpo", cluster.describe(), why_not="one GPU type (torchrun, one FSDP group)")
    device, n = one
    w = cost.workload
    run = PeerRun("dancegrpo", f"{n}x{device}", samples=w.samples, devices=n)
    # memory: the memory model's colocated setups sampling one sample at a time (FSDP over the GPUs,
    # checkpointing as needed); none at micro-batch 1 means DanceGRPO would need its sp_size, not modelled
    fits, _ = cost.memory.colocated(device, n, 1 / w.group_size)
    if not any(f.micro_batch == 1 for f in fits):
        run.why_not = "batch 1 does not fit without sequence parallelism (sp_size, not modelled)"
        return run
    per = w.samples / n
    t = _times(cost, device, checkpointing=True)
    fp32_gather = _collective_s(cost, device, n, w.params.total * FP32_BYTES)

    forward = t.rollout_step(1)
    sampling = per * w.steps * (forward + _unhidden(cost, fp32_gather, forward))
    scoring = t.decode(per) + t.reward(per)

    step = t.train_step(1)
    grads = _collective_s(cost, device, n, w.trained_params * FP32_BYTES)  # fp32 reduce-scatter
    training = per * w.trained_steps * (step + _unhidden(cost, 2 * fp32_gather + grads, step))
    optimizer = w.optimizer_steps * _sharded_optimizer(cost, device, n)
    run.phases = {
        "sampling (batch 1)": sampling,
        "decode + reward": scoring,
        "training": training,
        "optimizer": optimizer,
    }
    run.iteration_s = sum(run.phases.values())
    return run


def _sharded_optimizer(cost, device: str, n: int) -> float:
    """One AdamW step over the trained fp32 state held by one of ``n`` FSDP ranks."""

    w, p = cost.workload, cost.params
    state = w.trained_params / (n if not w.lora else 1) * p.trained_state_bytes
    return OPTIMIZER_STATE_PASSES * state / (DEVICES[device].mem_bw * p.mem_bw_efficiency) + OPTIMIZER_FIXED_S


# -------------------------------------------------------------------------- flow_grpo


def flow_grpo(cost, cluster) -> PeerRun:
    """DDP on every GPU: sampling on the training model in the train batch, rewards on the same GPU,
    each mini-batch trained then one all-reduce of the trained gradients and an AdamW step."""
    one = _one_type(cluster)
    if one is None:
        return PeerRun("flow_grpo", cluster.describe(), why_not="one GPU type (accelerate, one DDP group)")
    device, n = one
    w = cost.workload
    run = PeerRun("flow_grpo", f"{n}x{device}", samples=w.samples, devices=n)
    # a DDP replica holds the whole model, its trained state and the sampling state on each GPU: the
    # memory model's unsharded colocated setups (the largest micro-batch up to the configured one)
    fits, _ = cost.memory.colocated(device, n, 1)
    fits = [f for f in fits if f.shard == 1 and f.micro_batch <= w.micro_batch]
    if not fits:
        run.why_not = "a DDP replica (weights, trained state, activations) does not fit one GPU"
        return run
    top = max(f.micro_batch for f in fits)
    setup = min((f for f in fits if f.micro_batch == top), key=lambda f: (f.checkpointing, not f.cfg_batched))
    per = w.samples / n
    t = _times(cost, device, checkpointing=setup.checkpointing, cfg_batched=setup.cfg_batched)
    mb = setup.micro_batch
    calls, b = _batches(per, mb)
    sampling = w.steps * calls * t.rollout_step(b) + t.encode(w.prompts / n) + t.decode(per)
    reward = t.reward(per)
    S = w.optimizer_steps
    calls, b = _batches(per / S, mb)
    allreduce = 2 * _collective_s(cost, device, n, w.trained_params * FP32_BYTES)
    training = S * (w.trained_steps * calls * t.train_step(b) + allreduce + t.optimizer())
    run.phases = {"sampling": sampling, "reward": reward, "training": training}
    run.iteration_s = sum(run.phases.values())
    return run


MODELS = {
    "verl_omni_colocated": verl_omni_colocated,
    "verl_omni_separate_async": verl_omni_separate_async,
    "dancegrpo": dancegrpo,
    "flow_grpo": flow_grpo,
}


def peers(cost, cluster) -> dict[str, PeerRun]:
    """Every peer as it runs this workload on this cluster (:data:`MODELS`). The peers run one GPU type:
    on a mixed cluster, each on the devices of the type that serves it best (the others idle; the per
    GPU figure counts only the GPUs it uses)."""
    out = {}
    for name, model in MODELS.items():
        if len(cluster.devices) == 1:
            out[name] = model(cost, cluster)
            continue
        runs = []
        for device in cluster.devices:
            sub = cluster.model_copy(update={"pools": [p for p in cluster.pools if p.device == device]})
            run = model(cost, sub)
            run.where = f"{run.where} (of {cluster.describe()})"
            runs.append(run)
        fitting = [r for r in runs if r.fits]
        out[name] = max(fitting, key=lambda r: r.samples_per_s) if fitting else runs[0]
    return out
