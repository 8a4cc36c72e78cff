"""veRL-Omni as it ran for its published figures and as its examples run today: one step phase by phase
(``gen -> reward -> old_log_prob -> update_actor -> update_weights``), with the rollout server's batching
(``max_num_seqs``: serial, request-level or step-wise), the bypass mode, async reward on a GPU of its own
and ``separate_async``. Every term cites the file and line that shows it (:data:`SOURCES`; commits in
docs/scaling.md, "What veRL-Omni ran")."""

from __future__ import annotations

from dataclasses import dataclass, replace

from digenrl.placement.devices import DEVICES
from digenrl.planner.constants import ADAMW_STATE_BYTES, FP32_BYTES
from digenrl.planner.efficiency import device_efficiency
from digenrl.planner.judge import JudgeModel
from digenrl.planner.peer_run import (
    PeerRun,
    batches,
    collective_s,
    host_s,
    one_type,
    times,
    unhidden,
    weights_fit,
)

_V = "verl-project/verl-omni"
_LORA = "examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh"
_TRAINER = "verl_omni/trainer/diffusion/ray_diffusion_trainer.py"
_COMMON = [
    (
        "phases gen (:1160) -> reward (:1180) -> old_log_prob (:1200) -> update_actor -> update_weights, "
        "one after another; the server slept after gen (sleep_replicas, :1167) and woken by the push",
        _V,
        f"{_TRAINER}:1158-1218",
    ),
    (
        "one request per image: a task per row of prompts x rollout.n (diffusion_agent_loop.py:207-216, "
        "utils.py:20); true CFG = two transformer calls per step of the same requests",
        _V,
        "verl_omni/pipelines/qwen_image_flow_grpo/vllm_omni_rollout_adapter.py:443,456",
    ),
    (
        "serial unless the pipeline batches requests: max_num_seqs clamped to 1 without "
        "supports_request_batch (request-level batching landed 2026-07-24, after every published row)",
        _V,
        "verl_omni/workers/rollout/vllm_rollout/vllm_omni_async_server.py:311-329",
    ),
    (
        "offload on (:43-44); micro-batch 16 (:41), log-prob micro-batch 32 (:46); 2 mini-batches (:40); "
        "judge Qwen3-VL-8B at TP 4 on the same GPUs (:11, :16, :64-68); sde_window_size 2 (:57)",
        _V,
        f"{_LORA}:11-68",
    ),
    (
        "gradient checkpointing on (enable_gradient_checkpointing: True)",
        _V,
        "verl_omni/trainer/config/diffusion/model/diffusion_model.yaml",
    ),
    (
        "10 sampling steps at 512 x 512 (num_inference_steps: 10, height / width 512)",
        _V,
        "verl_omni/trainer/config/diffusion/rollout/diffusion_rollout.yaml:237-243",
    ),
]
SOURCES: dict[str, list[tuple[str, str, str]]] = {
    "verl_omni_colocated": [
        *_COMMON,
        (
            "as its examples run today: LoRA request-level at the yaml default max_num_seqs 8 (:21, :61); "
            "full model step-wise (step_execution=true) at max_num_seqs = log-prob micro-batch 32",
            _V,
            f"{_LORA}:21,61 + examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr.sh:24-27,65",
        ),
    ],
    "verl_omni_batched": [
        *_COMMON,
        (
            "request-level batching at max_num_seqs 32 (the measured 226.4 s -> 107.9 s; <= 32 for LoRA + "
            "true CFG at 512^2 or OOM)",
            _V,
            "docs/start/rollout_batching.md:116-131",
        ),
        (
            "bypass_mode: no old-log-prob recompute (old = rollout log-probs; 'save ~20% per-step time')",
            _V,
            "examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora_rollout_corr.sh:9,41",
        ),
    ],
    "verl_omni_async_reward": [
        *_COMMON,
        (
            "the judge on GPUs of its own (NUM_GPUS_REWARD=1, REWARD_TP=1), scoring while the others "
            "generate; actor and rollout on the rest",
            _V,
            "examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora_async_reward.sh:14-17,56-62",
        ),
    ],
    "verl_omni_separate_async": [
        (
            "a standalone rollout pool one step off the trainer; weights pushed every iteration",
            _V,
            "verl_omni/trainer/diffusion/v1/trainer_separate_async.py",
        ),
    ],
}


@dataclass(frozen=True)
class VerlOmniSettings:
    """veRL-Omni's knobs (defaults: as its published runs set them) and the push's fixed part read off
    its published breakdown (benchmarks/peer_calibration.py)."""

    server_batch: int = 1  # max_num_seqs: 1 = serial (every published row), else requests per forward
    cfg_batched: bool = False  # true CFG: two transformer calls per step (adapter :443 / :456)
    bypass: bool = False  # bypass_mode: no old-log-prob recompute
    micro_batch: int = 16  # ppo_micro_batch_size_per_gpu
    log_prob_micro_batch: int = 32  # log_prob_micro_batch_size_per_gpu
    checkpointing: bool = True  # enable_gradient_checkpointing
    param_offload: bool = True
    optimizer_offload: bool = True
    # fixed part of update_weights beyond the modelled moves (wake, layered summon, server load):
    # 10.2 s published - the moves predicted on 4xH800 (peer_calibration.py prints the fit)
    push_latency_s: float = 9.8
    # FSDP shard group of the actor (fsdp_config.fsdp_size): 0 = every GPU of the actor (veRL-Omni's
    # scripts); 1 = a replica per GPU, no parameter all-gather (MM-GRPO's fsdp_size=1)
    fsdp_size: int = 0
    # separate_async only: the rollout pool's GPUs as published (MM-GRPO's a1_r2 / a2_r1 splits);
    # None = the best split
    rollout_gpus: int | None = None
    # a request-serving front end (vllm-omni's agent loop) that pays ``CostParams.serve_request_s`` per
    # image; MM-GRPO's in-process diffusers rollout has none
    server: bool = True
    # a VLM judge launched per micro-batch inside generation and awaited at its end (MM-GRPO:
    # compute_reward_async, diffusers_rollout.py:193-221), priced from its architecture (judge.py)
    judge: JudgeModel | None = None
    # reward_model.enable_resource_pool=True: every image's score streamed from a judge on this many GPUs
    # of its own into the agent loop, awaited inside the gen timer (ray_diffusion_trainer.py:668-687)
    judge_streamed_gpus: int = 0


#: as the published rows ran (every row of docs/algo/performance.md predates request batching: serial)
PUBLISHED = VerlOmniSettings()
#: the examples today: LoRA request-level at 8, full model step-wise at 32 (the log-prob micro-batch)
TODAY_LORA = replace(PUBLISHED, server_batch=8)
TODAY_FULL = replace(PUBLISHED, server_batch=32)
#: the fastest its docs measured and its examples show: request-level 32 + bypass mode
BATCHED = replace(PUBLISHED, server_batch=32, bypass=True)


def today(w) -> VerlOmniSettings:
    return TODAY_LORA if w.lora else TODAY_FULL


def verl_omni_phases(cost, device: str, n: int, s: VerlOmniSettings = PUBLISHED) -> dict[str, float]:
    """Seconds of each phase of one colocated veRL-Omni step on ``n`` devices of ``device``."""
    w, p = cost.workload, cost.params
    per = w.samples / n  # samples each GPU generates, scores and trains
    T, S = w.trained_steps, w.optimizer_steps
    # the server: an unsharded bf16 copy (TP 1), vLLM-Omni's fused transformer
    roll = times(cost, device, cfg_batched=s.cfg_batched, fused=s.server)
    train = times(cost, device, checkpointing=s.checkpointing)
    weights = w.params.total * w.dtype_bytes
    shard = min(n, s.fsdp_size) if s.fsdp_size else n
    actor_shard = weights / shard  # FSDP-sharded actor parameters on each GPU

    calls, b = batches(per, s.server_batch)
    wake = host_s(cost, device, weights)  # the slept server's weights back from host memory
    # the prompt encoded per request, and the negative prompt too with CFG (veRL-Omni's Qwen-Image adapter
    # :330-348 at 36cdadf3; MM-GRPO's pipeline call per micro-batch of images, diffusers_rollout.py:158)
    encode = roll.encode(per * w.passes)
    generation = w.steps * calls * roll.rollout_step(b) + encode + roll.decode(per) + wake
    generation += per * p.serve_request_s if s.server else 0.0
    if s.judge_streamed_gpus:  # scored while generated; the last image's score after it
        generation = max(generation, w.samples * p.model_reward_s / s.judge_streamed_gpus) + p.model_reward_s
    if s.judge:  # MM-GRPO: each micro-batch's requests sent once generated, all awaited after the loop
        # (diffusers_rollout.py:193-201, 213-221 at d91797e): the last micro-batch of every GPU is
        # prefilled, then decoded for a whole answer with every request of the n GPUs still in flight
        # (a micro-batch generates in less than an answer's decode)
        e = device_efficiency(p, device)
        generation += s.judge.tail_s(
            b * n,
            calls * b * n,
            w.shape.tokens.pixels,
            DEVICES[device],
            e.rollout,
            p.mem_bw_efficiency,
            p.serve_seq_step_s,
        )

    reward = roll.reward(per)  # the judge on the same GPUs (p.model_reward_s per image)

    onload = host_s(cost, device, actor_shard) if s.param_offload else 0.0
    calls, b = batches(per, s.log_prob_micro_batch)
    gather = collective_s(cost, device, shard, weights)  # FSDP all-gather of the actor per forward
    forward = train.ref_forward(b)
    recompute = T * calls * (forward + unhidden(cost, gather, forward))
    old_log_prob = 0.0 if s.bypass else onload + recompute
    # with a KL term (use_kl_loss) the reference's log-probs: one more forward over every trained step,
    # the actor with its LoRA off (ref_in_actor), bypass or not (ray_diffusion_trainer.py:1224-1228,
    # _compute_ref_log_prob :1008, at a1139baf)
    ref = recompute if w.kl else 0.0

    calls, b = batches(per / S, s.micro_batch)
    step_compute = train.train_step(b)
    per_call = step_compute + unhidden(cost, 2 * gather, step_compute)  # gathers in forward and backward
    grads = 2 * collective_s(cost, device, n, w.trained_params * FP32_BYTES)  # reduce-scatter + all-gather
    opt_state = w.trained_params * ADAMW_STATE_BYTES / (n if not w.lora else 1)
    opt_moves = 2 * host_s(cost, device, opt_state) if s.optimizer_offload else 0.0
    update_actor = S * (T * calls * per_call + grads + train.optimizer()) + opt_moves

    push = collective_s(cost, device, n, w.sync_bytes) + w.sync_bytes / (
        DEVICES[device].mem_bw * p.mem_bw_efficiency
    )
    offload = host_s(cost, device, actor_shard) if s.param_offload else 0.0
    update_weights = onload + push + offload + s.push_latency_s
    dispatch = p.dispatch_s_per_worker * n  # the controller's per-worker work each step
    return {
        "generation": generation,
        "reward": reward,
        "old_log_prob": old_log_prob,
        **({"ref_log_prob": ref} if w.kl else {}),
        "update_actor": update_actor,
        "update_weights": update_weights,
        **({"dispatch": dispatch} if dispatch else {}),
    }


def _colocated(name: str, cost, cluster, s: VerlOmniSettings, judge_gpus: int = 0) -> PeerRun:
    """Every GPU but ``judge_gpus`` generates and trains; the judge runs beside them (``judge_gpus``
    > 0: on GPUs of its own, scoring while the images are generated) or after generation (0)."""
    one = one_type(cluster)
    if one is None:
        return PeerRun(name, cluster.describe(), why_not="one GPU type per resource pool")
    device, total = one
    n = total - judge_gpus
    w = cost.workload
    run = PeerRun(name, f"{total}x{device}", samples=w.samples, devices=total)
    if n < 1:
        run.why_not = "needs a GPU for the judge and one for the actor"
        return run
    if not weights_fit(cost, device, w.params.total * w.dtype_bytes):
        run.why_not = "the server's bf16 copy of the weights does not fit one GPU (rollout TP 1)"
        return run
    run.phases = verl_omni_phases(cost, device, n, s)
    if judge_gpus:  # the same images scored on judge_gpus instead of n GPUs, hidden behind generation
        alone = run.phases.pop("reward") * n / judge_gpus
        run.phases["reward (beyond generation)"] = max(0.0, alone - run.phases["generation"])
        run.where = f"{n}x{device} + judge {judge_gpus}x{device}"
    run.iteration_s = sum(run.phases.values())
    return run


def verl_omni_colocated(cost, cluster, s: VerlOmniSettings | None = None) -> PeerRun:
    """As its examples run today (``s``: another setting, e.g. :data:`PUBLISHED`)."""
    return _colocated("verl_omni_colocated", cost, cluster, s or today(cost.workload))


def verl_omni_batched(cost, cluster, s: VerlOmniSettings = BATCHED) -> PeerRun:
    """Request-level batching at 32 and the bypass mode: the fastest its docs and examples show."""
    return _colocated("verl_omni_batched", cost, cluster, s)


def verl_omni_async_reward(cost, cluster, s: VerlOmniSettings | None = None) -> PeerRun:
    """One GPU for the judge (run_qwen_image_ocr_lora_async_reward.sh), the rest as today."""
    return _colocated("verl_omni_async_reward", cost, cluster, s or today(cost.workload), judge_gpus=1)


def verl_omni_separate_async(cost, cluster, s: VerlOmniSettings | None = None) -> PeerRun:
    """The best split (``s.rollout_gpus``: the published one): rollout pool of r GPUs (server awake,
    reward on it), trainer pool of n - r (no offload needed), one step off: ``max(rollout, train) +
    weight push``."""
    s = s or today(cost.workload)
    one = one_type(cluster)
    if one is None or one[1] < 2:
        return PeerRun("verl_omni_separate_async", cluster.describe(), why_not="needs 2+ GPUs of one type")
    device, n = one
    w = cost.workload
    best = PeerRun("verl_omni_separate_async", f"{n}x{device}", why_not="does not fit")
    if not weights_fit(cost, device, w.params.total * w.dtype_bytes):
        return best
    if s.rollout_gpus is not None and not 0 < s.rollout_gpus < n:
        best.why_not = f"a rollout pool of {s.rollout_gpus} of {n} GPUs leaves none to one side"
        return best
    quiet = replace(s, param_offload=False, optimizer_offload=False)
    for r in [s.rollout_gpus] if s.rollout_gpus else range(1, n):
        roll = verl_omni_phases(cost, device, r, quiet)
        train = verl_omni_phases(cost, device, n - r, quiet)
        wake = host_s(cost, device, w.params.total * w.dtype_bytes)  # a dedicated server stays awake
        rollout_side = roll["generation"] - wake + roll["reward"]
        train_side = train["old_log_prob"] + train.get("ref_log_prob", 0.0) + train["update_actor"]
        wire = w.sync_bytes / (cost.cluster.interconnect.bandwidth_gb_s * 1e9)  # trainer -> server pool
        push = wire + s.push_latency_s + cost.params.dispatch_s_per_worker * n
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
