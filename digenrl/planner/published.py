"""The peers' published setups and numbers the cost model is calibrated on and checked against.

Details: docs/modules.md, `digenrl.planner.published`.
"""

from __future__ import annotations

from digenrl.planner.published_sd3 import MM_GRPO
from digenrl.planner.published_setup import PublishedSetup

#: veRL-Omni's published Qwen-Image LoRA step (verl-project/verl-omni PR #52: the per-phase timing of
#: run_qwen_image_ocr_lora.sh, colocated, 4 GPUs), in seconds
VERL_OMNI_PHASES = {
    "generation": 228.2,
    "update_actor": 109.3,
    "old_log_prob": 32.0,
    "reward": 29.1,
    "update_weights": 10.2,
}
#: the same workload's generation phase (gen excluding step 1), serial vs request-level batching at
#: max_num_seqs 32 (verl-project/verl-omni docs/start/rollout_batching.md:131 at fe5bb1a7, 2026-07-30):
#: requests per forward -> seconds; a request is one image, true CFG two calls per step
VERL_OMNI_GENERATION = {1: 226.4, 32: 107.9}
VERL_OMNI_GENERATION_SOURCE = (
    "verl-project/verl-omni docs/start/rollout_batching.md:131 (fe5bb1a7, 2026-07-30)"
)
#: ... and its performance table (docs/algo/performance.md): 0.305 images/GPU/s at 420 s/step on 4xH800
VERL_OMNI_STEP_S = 420.0
VERL_OMNI_IMAGES_PER_GPU_S = 0.305
#: the phases the kernel efficiencies predict; the other two are inputs read off the breakdown
PREDICTED_PHASES = ("generation", "update_actor", "old_log_prob")


#: text tokens per pass of veRL-Omni's Qwen-Image rollout and actor: the chat template's 34-token prefix
#: dropped and the padding stripped (pipelines/qwen_image_flow_grpo/common.py:46-76 at a1139baf;
#: workers/utils/padding.py). Its OCR prompts (flow_grpo dataset/ocr: data_process/qwenimage_ocr.py:16)
#: average 212.6 characters, ~47 tokens at ~4.5 characters per token, + the template's 5-token suffix;
#: the negative prompt " " (:59) keeps ~6. DigenRL pads to ``model.max_text_len`` (256).
QWEN_TEXT_TOKENS = {"cond": 52, "uncond": 6}
_TEXT_CFG = f"model.max_text_len={sum(QWEN_TEXT_TOKENS.values()) // 2}"  # one pass of each: their mean
_TEXT_ONE = f"model.max_text_len={QWEN_TEXT_TOKENS['cond']}"  # no CFG: the prompt's pass only

_VERL_QWEN = (
    _TEXT_CFG,
    "train.prompts_per_iteration=32",  # data.train_batch_size=32
    "algorithm.timesteps.mode=window",  # sde_window_size=2: two SDE (trained) steps
    "algorithm.timesteps.window=2",
    "train.optimizer_steps=2",  # ppo_mini_batch_size=16 of 32 prompts
    "train.micro_batch=16",  # ppo_micro_batch_size_per_gpu=16
)

CALIBRATION = PublishedSetup(
    name="veRL-Omni Qwen-Image LoRA r64 OCR, colocated, 4xH800",
    config="qwen_image.yaml",
    overrides=_VERL_QWEN,
    cluster="4xH800",
    peer="verl_omni_colocated",
    published_step_s=VERL_OMNI_STEP_S,
    published_images_per_gpu_s=VERL_OMNI_IMAGES_PER_GPU_S,
    source="verl-project/verl-omni docs/algo/performance.md + PR #52 (phase breakdown)",
)

_H = "verl-project/verl-omni docs/algo/performance.md"
_FULL = (*_VERL_QWEN, _TEXT_ONE, "model.lora=null", "sampling.guidance=1.0")  # true_cfg_scale=1.0: one pass

OUT_OF_SAMPLE = (
    PublishedSetup(
        name="veRL-Omni Qwen-Image LoRA, async reward on a 5th GPU, 5xH800",
        config="qwen_image.yaml",
        overrides=_VERL_QWEN,
        cluster="5xH800",
        peer="verl_omni_async_reward",
        published_step_s=360.0,
        published_images_per_gpu_s=0.280,
        source=f"{_H} (1cf9aa94, 2026-04-24: run_qwen_image_ocr_lora_async_reward.sh)",
        caveat="serial generation (published before request batching); the judge at TP 1 on the 5th GPU "
        "at the calibrated GPU-seconds per image, hidden behind generation",
    ),
    PublishedSetup(
        name="veRL-Omni Qwen-Image full fine-tune, no CFG, 4xH200",
        config="qwen_image.yaml",
        overrides=_FULL,
        cluster="4xH200",
        peer="verl_omni_colocated",
        published_step_s=250.0,
        published_images_per_gpu_s=0.510,
        source=f"{_H} (c415a591, 2026-05-14: run_qwen_image_ocr.sh)",
        caveat="serial generation (published before step-wise batching, 2026-07-24); another model mode "
        "(full weights, one pass) and GPU",
    ),
    PublishedSetup(
        name="veRL-Omni Qwen-Image full fine-tune, no CFG, 64xH100 (FSDP1)",
        config="qwen_image.yaml",
        overrides=_FULL,
        cluster="64xH100",
        peer="verl_omni_colocated",
        published_step_s=105.0,
        published_images_per_gpu_s=0.077,
        source=f"{_H} (d07f42ba, 2026-06-05: run_qwen_image_ocr.sh, 64 GPUs)",
        settings={"param_offload": False},  # the row's note: param_offload=False, optimizer_offload=True
        caveat="at 8 images per GPU most of the step is what does not shrink with the work per GPU: the "
        "single controller's per-worker cost (dispatch_s_per_worker x 64), fitted on every row",
    ),
    PublishedSetup(
        name="veRL-Omni Qwen-Image full fine-tune, no CFG, 64xH100 (VeOmni)",
        config="qwen_image.yaml",
        overrides=_FULL,
        cluster="64xH100",
        peer="verl_omni_colocated",
        published_step_s=100.0,
        published_images_per_gpu_s=0.079,
        source=f"{_H} (d07f42ba, 2026-06-05: run_qwen_image_ocr_veomni.sh, 64 GPUs)",
        settings={"param_offload": False},
        caveat="as the FSDP1 row (modelled the same: VeOmni's own sharding is not modelled)",
    ),
    PublishedSetup(
        name="veRL-Omni Qwen-Image LoRA FlowDPPO, 4xH200",
        config="qwen_image.yaml",
        overrides=_VERL_QWEN,
        cluster="4xH200",
        peer="verl_omni_colocated",
        published_step_s=540.0,
        published_images_per_gpu_s=0.240,
        source=f"{_H} (36cdadf3, 2026-06-17: flowdppo_trainer/qwen_image/run_qwen_image_ocr_lora.sh)",
        caveat="not explained: FlowDPPO's loss is modelled as Flow-GRPO's (a forward + backward per "
        "trained step); its KL terms (loss_mode=flow_dppo, add_kl_coefficient, kl_mask_threshold in the "
        "script) are not, nor anything else the 137 s missing would be",
    ),
    PublishedSetup(
        name="veRL-Omni Qwen-Image LoRA DiffusionNFT, no CFG, 4xH200",
        config="qwen_image.yaml",
        overrides=(
            "train.prompts_per_iteration=24",  # data.train_batch_size=24 (rollout.n=16: 384 images)
            "train.optimizer_steps=2",  # ppo_mini_batch_size=12 of 24
            "train.micro_batch=12",
            "algorithm.name=diffusion_nft",
            _TEXT_ONE,
            "sampling.guidance=1.0",  # true_cfg_scale=1.0
            "algorithm.kl_beta=0.0001",  # ref_kl_coef (script :43): a reference forward per trained term
        ),
        cluster="4xH200",
        peer="verl_omni_colocated",
        published_step_s=550.0,
        published_images_per_gpu_s=0.175,
        source=f"{_H} (36cdadf3, 2026-06-17: diffusionnft_trainer/qwen_image/run_qwen_image_ocr_lora.sh)",
        # the reference forward runs inside the update at its micro-batch (diffusers_impl.py:1188-1210 at
        # 36cdadf3), not at the log-prob micro-batch
        settings={"micro_batch": 12, "log_prob_micro_batch": 12},
        caveat="the row says 24 x 12, the script 24 prompts x rollout.n 16 (0.175 x 4 x 550 = 385 images: "
        "the script's); NFT's training passes counted as DigenRL's diffusion_nft counts them, with the "
        "reference KL's forward (ref_kl_coef, script :43)",
    ),
    PublishedSetup(
        name="DanceGRPO FLUX.1-dev full fine-tune, 16xH800",
        config="recipes/dancegrpo_flux_hpsv2.yaml",
        overrides=(),
        cluster="16xH800",
        peer="dancegrpo",
        published_step_s=12 * 3600 / 200,
        published_images_per_gpu_s=None,
        source="XueZeyue/DanceGRPO README.md: 200 iterations 'within 12 hours' on 16 H800 (an upper "
        "bound: 216 s per iteration or less)",
        caveat="the published figure is a bound ('within 12 hours'), not a measured step time; HPSv2.1 "
        "is scored at the default 10 ms per image on the GPU",
    ),
)

# the SD3.5 rows (MM-GRPO's one-step-off table and its hybrid row): digenrl/planner/published_sd3.py
OUT_OF_SAMPLE = (*OUT_OF_SAMPLE, *MM_GRPO)

#: published figures the model cannot check
NOT_CHECKED = (
    "veRL-Omni separate_async SD3.5: no published figure. docs/algo/separate_async_omni.md (only on PR "
    "#380's branch, 3eebed60) is Qwen3-Omni's AR recipe and states no time; the SD3.5 script "
    "(examples/flowgrpo_trainer/sd35/run_sd35_medium_ocr_lora_v1_separate_async.sh) states none; PR #315 "
    "says 'hard to compare performance' and gives none; PR #575's table is a 5B video model's",
)
