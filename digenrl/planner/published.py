"""The peers' published setups and numbers the cost model is calibrated on and checked against.

Each :class:`PublishedSetup` is a shipped config + the overrides that make it the peer's published
run, the cluster it ran on, the peer model (:mod:`~digenrl.planner.peers`) and what was published.
``benchmarks/peer_calibration.py`` fits the kernel efficiencies to :data:`CALIBRATION` and checks
them on :data:`OUT_OF_SAMPLE`; docs/scaling.md prints both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from digenrl.config.run import load_config
from digenrl.planner.gpus import load_cluster

ROOT = Path(__file__).resolve().parents[2]

#: veRL-Omni's published Qwen-Image LoRA step (verl-project/verl-omni PR #52: the per-phase timing of
#: run_qwen_image_ocr_lora.sh, colocated, 4 GPUs), in seconds
VERL_OMNI_PHASES = {
    "generation": 228.2,
    "update_actor": 109.3,
    "old_log_prob": 32.0,
    "reward": 29.1,
    "update_weights": 10.2,
}
#: ... and its performance table (docs/algo/performance.md): 0.305 images/GPU/s at 420 s/step on 4xH800
VERL_OMNI_STEP_S = 420.0
VERL_OMNI_IMAGES_PER_GPU_S = 0.305
#: the phases the kernel efficiencies predict; the other two are inputs read off the breakdown
PREDICTED_PHASES = ("generation", "update_actor", "old_log_prob")


@dataclass(frozen=True)
class PublishedSetup:
    name: str
    config: str  # under configs/
    overrides: tuple[str, ...]
    cluster: str  # configs/clusters/<cluster>.yaml
    peer: str  # peers.MODELS key
    published_step_s: float
    published_images_per_gpu_s: float | None
    source: str  # where the number is published
    model_reward: bool = True  # the reward is a model on the GPUs (its per-image cost applies)
    settings: dict = field(default_factory=dict)  # VerlOmniSettings overrides (veRL-Omni setups)
    caveat: str = ""

    def workload(self):
        from digenrl.planner.workload import Workload

        w = Workload.from_config(load_config(ROOT / "configs" / self.config, list(self.overrides)))
        return replace(w, reward_kind="model") if self.model_reward else w

    def load_cluster(self):
        return load_cluster(ROOT / "configs" / "clusters" / f"{self.cluster}.yaml")


_VERL_QWEN = (
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

OUT_OF_SAMPLE = (
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
    PublishedSetup(
        name="veRL-Omni Qwen-Image full fine-tune, no CFG, 4xH200",
        config="qwen_image.yaml",
        overrides=(*_VERL_QWEN, "model.lora=null", "sampling.guidance=1.0"),
        cluster="4xH200",
        peer="verl_omni_colocated",
        published_step_s=250.0,
        published_images_per_gpu_s=0.510,
        source="verl-project/verl-omni docs/algo/performance.md (run_qwen_image_ocr.sh: 0.510 images/GPU/s, "
        "250 s/step)",
        settings={"server_batch": 256},  # max_num_seqs 256 in run_qwen_image_ocr.sh
        caveat="same system as the calibration (its judge and push latency carried over), another "
        "model mode (full weights, one pass) and GPU",
    ),
)

#: published figures the model cannot check
NOT_CHECKED = (
    "MM-GRPO's one-step-off table (3xH800) uses SD3.5, a family DigenRL does not have: not checked",
)
