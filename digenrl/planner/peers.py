"""The peers as they run: each published system's iteration, phase by phase, with its structural costs.

Details: docs/modules.md, `digenrl.planner.peers`.
"""

from __future__ import annotations

from digenrl.placement.devices import DEVICES
from digenrl.planner.constants import FP32_BYTES, OPTIMIZER_FIXED_S, OPTIMIZER_STATE_PASSES
from digenrl.planner.peer_run import PeerRun, batches, collective_s, one_type, times, unhidden
from digenrl.planner.peer_verl_omni import SOURCES as VERL_SOURCES
from digenrl.planner.peer_verl_omni import (
    verl_omni_async_reward,
    verl_omni_batched,
    verl_omni_colocated,
    verl_omni_separate_async,
)

#: (what, repository, path) for every structural term of each peer model
SOURCES: dict[str, list[tuple[str, str, str]]] = {
    **VERL_SOURCES,
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


# -------------------------------------------------------------------------- DanceGRPO


def dancegrpo(cost, cluster) -> PeerRun:
    """Every GPU: its prompts' samples at batch 1 through the FULL_SHARD fp32 FSDP module (an fp32
    all-gather per forward), decode + reward on the GPU, then every sample's trained steps at batch 1
    (gather in forward and backward, fp32 reduce-scatter every backward), ``optimizer_steps`` steps."""
    one = one_type(cluster)
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
    t = times(cost, device, checkpointing=True)
    fp32_gather = collective_s(cost, device, n, w.params.total * FP32_BYTES)

    forward = t.rollout_step(1)
    sampling = per * w.steps * (forward + unhidden(cost, fp32_gather, forward))
    scoring = t.decode(per) + t.reward(per)

    step = t.train_step(1)
    grads = collective_s(cost, device, n, w.trained_params * FP32_BYTES)  # fp32 reduce-scatter
    training = per * w.trained_steps * (step + unhidden(cost, 2 * fp32_gather + grads, step))
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
    one = one_type(cluster)
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
    t = times(cost, device, checkpointing=setup.checkpointing, cfg_batched=setup.cfg_batched)
    mb = setup.micro_batch
    calls, b = batches(per, mb)
    sampling = w.steps * calls * t.rollout_step(b) + t.encode(w.prompts / n) + t.decode(per)
    reward = t.reward(per)
    S = w.optimizer_steps
    calls, b = batches(per / S, mb)
    allreduce = 2 * collective_s(cost, device, n, w.trained_params * FP32_BYTES)
    # with a KL term (train.beta > 0) every trained step also runs the reference: the same call with the
    # LoRA off, no grad (yifan123/flow_grpo scripts/train_sd3.py:875-878 at ac4c86e; the same in its
    # train_flux.py at 74db6919, train_wan2_1.py and the Qwen-Image / Kontext trainers)
    ref = t.ref_forward(b) if w.kl else 0.0
    training = S * (w.trained_steps * calls * (t.train_step(b) + ref) + allreduce + t.optimizer())
    # two phase switches per iteration on the same GPUs (pipeline.transformer.eval() to sample, .train()
    # to train: train_sd3.py:602 / :844 at ac4c86e), at the latency the cost model assumes for every
    # colocated arrangement, DigenRL's included (ColocationCosts.switch_latency_s)
    switches = 2 * cost.colocation.switch_latency_s  # 0 on a CPU cluster
    run.phases = {"sampling": sampling, "reward": reward, "training": training, "phase switches": switches}
    run.iteration_s = sum(run.phases.values())
    return run


MODELS = {
    "verl_omni_colocated": verl_omni_colocated,
    "verl_omni_batched": verl_omni_batched,
    "verl_omni_async_reward": verl_omni_async_reward,
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
