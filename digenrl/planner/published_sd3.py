"""The SD3.5 published figures, checked out of sample with the efficiencies fitted on veRL-Omni's
Qwen-Image figures (nothing refitted): MM-GRPO's one-step-off table and veRL-Omni's SD3.5
request-level batching row. What each ran, read from its code: docs/scaling/sd35_rows.md.

Details: docs/modules.md, `digenrl.planner.published`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from digenrl.config.run import load_config
from digenrl.planner.gpus import load_cluster
from digenrl.planner.judge import UNIFIED_REWARD_THINK_32B
from digenrl.planner.published_setup import PublishedSetup

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------- MM-GRPO (leibniz-csi/mm_grpo)

#: the table: examples/flowgrpo_trainer/experimental/README.md:93-97 at d91797e (2025-12-10; the
#: throughputs unchanged at 283eb27 and HEAD 301f5c0). "Throughput" is perf/throughput = images /
#: (step seconds x every GPU of every pool) (gerl/trainer/ppo/metric_utils.py:205,
#: ray_diffusion_trainer.py:1114, main_flowgrpo.py:206-211): the step seconds are images / (it x 3)
_MM = "leibniz-csi/mm_grpo"
_MM_TABLE = f"{_MM} examples/flowgrpo_trainer/experimental/README.md:93-97 (d91797e, 2025-12-10)"
_MM_SCRIPT = "examples/flowgrpo_trainer/experimental/run_sd3_fast_3p_a{}_r{}.sh"
MM_GRPO_GPUS = 3

#: run_sd3_fast_3p_a1_r2.sh @d91797e (a2_r1 differs only in :5, :18, :27, :39)
_MM_RUN = (
    "model.height=512",  # rollout.yaml:24,27 image_height / image_width 512
    "model.width=512",
    "model.max_text_len=512",  # T5 max_sequence_length = data.max_prompt_length 512 (:7; rollout.yaml:21,
    # diffusers_rollout.py:165)
    "model.dtype=float16",  # fsdp_config.dtype / rollout.dtype float16 (:24, :36)
    "sampling.steps=10",  # rollout.yaml:34 num_inference_steps 10
    "sampling.guidance=1.0",  # rollout.guidance_scale=1.0 (:31): one pass per step
    "algorithm.group_size=8",  # rollout.n=8 (:30)
    "algorithm.kl_beta=0",  # use_kl_loss=False (:20)
    "algorithm.timesteps.mode=window",  # sde_window_size=3 in sde_window_range [0,5] (:34-35)
    "algorithm.timesteps.window=3",
    "train.micro_batch=8",  # ppo_micro_batch_size_per_gpu=8 (:19)
    "train.optimizer_steps=2",  # ppo_mini_batch_size = half of data.train_batch_size (:5, :18)
)
#: what veRL-Omni's model needs told of how MM-GRPO ran (VerlOmniSettings fields)
_MM_SETTINGS = {
    "server_batch": 8,  # diffusers rollout in micro-batches of log_prob_micro_batch_size_per_gpu = the
    # ppo micro-batch 8 (diffusers_rollout.py:135,148; rollout.yaml:31)
    "micro_batch": 8,
    "log_prob_micro_batch": 8,
    "checkpointing": False,  # enable_gradient_checkpointing=False (:13)
    "param_offload": False,  # (:22-23)
    "optimizer_offload": False,
    "fsdp_size": 1,  # fsdp_config.fsdp_size=1 (:25): a replica per actor GPU
    # no vLLM server to wake and reload: the LoRA state dict goes actor -> rollout workers through Ray
    # (ray_diffusion_trainer.py:358-372, async_utils.py:18-24); veRL-Omni's fixed 9.8 s is not MM-GRPO's
    "push_latency_s": 0.0,
    "server": False,  # diffusers in the rollout worker's process: no request-serving front end
    # compute_reward_async per micro-batch (diffusers_rollout.py:193-221) to a 32B VLM judge
    "judge": UNIFIED_REWARD_THINK_32B,
}
_MM_REWARD = (
    "the reward (UnifiedReward-Think-qwen3vl-32b served by vLLM off these 3 GPUs, README.md:100) is "
    "launched per micro-batch inside generate_sequences and awaited after the loop (diffusers_rollout.py:"
    "193-221): priced from its architecture (planner/judge.py), not fitted"
)
#: what the model of the MM-GRPO rows rests on (the same for the three rows)
_MM_GAP = (
    "SD3.5-M's small calls priced by their kernels (op_counts.py); the judge launched per micro-batch "
    "inside generation, priced from its architecture (planner/judge.py)"
)


def _mm_row(actor: int, rollout: int, prompts: int, throughput: float, caveat: str) -> PublishedSetup:
    images = prompts * 8
    hybrid = rollout == MM_GRPO_GPUS
    return PublishedSetup(
        name=(
            "MM-GRPO SD3.5-M Flow-GRPO-Fast LoRA, "
            + ("hybrid engine (colocated)" if hybrid else f"one-step-off, {actor} actor + {rollout} rollout")
            + ", 3xH800"
        ),
        config="sd3.5_medium.yaml",
        overrides=(*_MM_RUN, f"train.prompts_per_iteration={prompts}"),
        cluster="3xH800",
        peer="verl_omni_colocated" if hybrid else "verl_omni_separate_async",
        published_step_s=round(images / (throughput * MM_GRPO_GPUS), 2),
        published_images_per_gpu_s=throughput,
        source=f"{_MM_TABLE}"
        + ("" if hybrid else f": {_MM_SCRIPT.format(actor, rollout)}")
        + f"; {throughput} images/GPU/s published, s/step = {images} images / ({throughput} x 3 GPUs)",
        model_reward=False,
        settings=_MM_SETTINGS if hybrid else {**_MM_SETTINGS, "rollout_gpus": rollout},
        caveat=caveat,
    )


MM_GRPO = (
    _mm_row(1, 2, 8, 1.07, f"{_MM_GAP}; {_MM_REWARD}"),
    _mm_row(2, 1, 16, 1.25, f"{_MM_GAP}; {_MM_REWARD}"),
    _mm_row(
        3,
        3,
        24,
        1.42,
        "the row has no script: its 24 prompts x rollout.n 8 on 3 GPUs with the one-step-off scripts' "
        "other settings and, as theirs, ppo_mini_batch_size half the batch (assumed); rollout and actor "
        "on the same GPUs, one after the other; at a2_r1 / a1_r2's implied rates 64 images per GPU take "
        f"~17 s to generate + ~20 s to train = ~37 s of the 45 s; {_MM_GAP}; {_MM_REWARD}",
    ),
)

# -------------------------------------------------------- veRL-Omni SD3.5 generation (verl-project/verl-omni)


@dataclass(frozen=True)
class PublishedGeneration:
    """A published generation phase at several server batch sizes (max_num_seqs -> seconds)."""

    name: str
    config: str
    overrides: tuple[str, ...]
    cluster: str
    gpus: int  # the GPUs that generate (the server replicas, TP 1)
    points: dict[int, float]
    source: str
    caveat: str = ""

    def workload(self):
        from digenrl.planner.workload import Workload

        return Workload.from_config(load_config(ROOT / "configs" / self.config, list(self.overrides)))

    def load_cluster(self):
        return load_cluster(ROOT / "configs" / "clusters" / f"{self.cluster}.yaml")


_SD35_SCRIPT = "examples/flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora.sh"
VERL_OMNI_SD35_GENERATION = PublishedGeneration(
    name="veRL-Omni SD3.5-M LoRA generation, 8 x 8 at 384^2, FA3, 2 GPUs (H800 assumed)",
    config="sd3.5_medium.yaml",
    overrides=(  # run_sd35_medium_ocr_lora.sh @9401c4b0 (unchanged at fe5bb1a7)
        "model.height=384",  # IMAGE_RESOLUTION=384 (:28, :79-80)
        "model.width=384",
        "model.max_text_len=256",  # pipeline.max_sequence_length=256 (:83)
        "sampling.steps=10",  # num_inference_steps=10 (:81)
        "sampling.guidance=1.0",  # guidance_scale=1.0 (:82): one pass per step
        "algorithm.group_size=8",  # rollout.n=8 (:75)
        "train.prompts_per_iteration=8",  # data.train_batch_size=8 (:47)
        "algorithm.kl_beta=0",  # use_kl_loss=False (:65)
    ),
    cluster="3xH800",
    gpus=2,  # NUM_GPUS_ACTOR_ROLLOUT=2, ROLLOUT_TP=1 (:24, :26): two servers; the judge on a 3rd (:25)
    points={1: 25.4, 256: 22.3},
    source="verl-project/verl-omni docs/start/rollout_batching.md:132 (fe5bb1a7, 2026-07-30; added as :128 "
    f"in 9401c4b0, 2026-07-24, PR #286); the run: {_SD35_SCRIPT} @9401c4b0",
    caveat="not explained by batching: the model prices the transformer's forwards (1/7 and 1/16 of the "
    "published), while the published phase barely moves with batching (-12%; the model -62%): ~22 s "
    "of it does not scale with the forwards. The gen timer (ray_diffusion_trainer.py:990-1001) also "
    "awaits every image's GenRM-OCR score (Qwen2.5-VL-3B on the 3rd GPU: reward_model.enable_resource_pool"
    "=True (:97) streams scoring into the agent loop, ray_diffusion_trainer.py:668-687, "
    "diffusion_agent_loop.py:257-262,277-305) and the per-request serving (agent loop, T5 prompt "
    "encoding, VAE decode, transfers): the judge is priced at the Qwen-Image reward phase's rate per image "
    "(model_reward_s), the rest is not. The GPU is not stated: FA3 (:36-39) runs on Hopper only "
    "(flash-attention 3 requires sm90), so H800 is assumed, as the Qwen-Image row of the same table; "
    "FA3 is not modelled apart from SDPA",
)
