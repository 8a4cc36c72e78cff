"""Every fixed number of the planner, named once. Tunable assumptions of the cost model are fields
of :class:`~digenrl.planner.params.CostParams` (and its siblings) instead; what was measured with
these settings is in docs/scaling.md ("Measured figures")."""

from __future__ import annotations

# rewards whose model runs elsewhere (a judge or detector service): the scoring worker only waits; and
# rewards with no model weights (functions of the pixels): named once, beside the reward config
from digenrl.config.train import FUNCTION_REWARDS, REMOTE_REWARDS  # noqa: F401

# ------------------------------------------------------------------------------ profile.json

PROFILE_VERSION = 1  # the profile.json format
DEFAULT_BATCHES = (1, 2, 4, 8, 16)  # batch sizes every profile measures
MAX_PROFILED_UNIT_SAMPLES = 64  # rollout units larger than this are extrapolated, not measured

# ------------------------------------------------------------------------------ reward costs

# seconds per image of rewards measured on a CPU core (benchmarks/ocr_reward.py: rendered text, one ONNX
# thread; benchmarks/RESULTS.md), by the image's side in px; a component's ``seconds_per_image`` wins
MEASURED_REWARD_S = {"ocr": ((64, 0.056), (256, 0.105), (512, 0.365))}
# model rewards that run on the scoring process's CPU (no weights on the device): kind "host"
HOST_REWARDS = frozenset({"ocr"})

# ------------------------------------------------------------------------- model-time rounds

TIMING_BUDGET_MIN_TIMES = 10  # the round-robin timing runs at least this many x ``min_time`` seconds
MAX_TIMING_ROUNDS = 40  # ... and stops after this many rounds once the budget or ``repeats`` is met

# ----------------------------------------------------------------------- CPU contention probe

SHARING_SLOT_S = 0.2  # neighbours compute in every other slot of this length
SHARING_MIN_SECONDS = 2.4  # the observer runs at least this long per worker count
SHARING_MIN_TIMES = 8  # ... and at least this many x ``min_time``
SHARING_START_S = 1.0  # the probe starts this long after forking (+ SHARING_START_PER_WORKER_S each)
SHARING_START_PER_WORKER_S = 0.2
SHARING_TIMEOUT_S = 60  # the observer answers within this (+ SHARING_TIMEOUT_PER_SECOND x its run time)
SHARING_TIMEOUT_PER_SECOND = 10
SHARING_JOIN_S = 10  # a probe process still alive this long after answering is killed
OTHER_LOAD_EVERY_S = 0.3  # /proc sampling period of the other-process load
NICE_WEIGHT_BASE = 1.25  # the fair scheduler weighs a thread at nice k as NICE_WEIGHT_BASE ** -k
MAX_ANCESTRY = 64  # parent links followed to decide whether a process is ours

# ------------------------------------------------------------------------------ Ray overheads

RAY_REPEATS = 30  # timed actor calls; transfers and put / get take a third of it (at least 5)
RAY_WARM_CALLS = 5
RAY_PROBE_CPUS = 0.01  # Ray CPUs a probe actor asks for (two fit beside anything)
SMALL_TRANSFER_BYTES = 1024  # the two transfer sizes: at least this, and
LARGE_TRANSFER_BYTES = 4 * 2**20  # at least this or LARGE_TRANSFER_UNITS x a unit's samples
LARGE_TRANSFER_UNITS = 8

# ------------------------------------------------------------------------- calibration run

CALIBRATION_ITERATIONS = 8  # iterations of the engine calibration run (the first is left out)

# ------------------------------------------------------------------------------ cost model

MIN_UNIT_CV = 0.02  # unit-time spreads below this are simulated as none
MIN_CALL_FRACTION = 0.5  # an interpolated call never costs less than this x the cheaper neighbour point
MIN_UNIT_FRACTION = 0.5  # a composed unit never costs less than this x the sum of its calls
OPTIMIZER_FIXED_S = 0.001  # per optimizer step beyond streaming the trained state
# Policy.agreement_digest (distributed/fingerprint.py): per trained tensor, an int16 view widened to
# int32 (read 2 B, write 4 B) and three reductions over the widened copy (4 B each): 14 B per 2 B read
FINGERPRINT_PASSES = 7.0
FINGERPRINT_KERNELS = 16  # launches per tensor (widen, row / column sums, weights, the three sums)
KERNEL_LAUNCH_S = 5e-6
OPTIMIZER_STATE_PASSES = 3  # an AdamW update reads / writes the trained state about this many times
FSDP_STEP_SHARE = (
    0.5  # FSDP: the step's all-reduce is an all-gather only (reduce-scatter ran in the backward)
)
MFU_CAP = 0.9  # a calibrated MFU above this is a measurement error
FP32_BYTES = 4  # LoRA weights, gradients and latents travel in fp32
HALF_BYTES = 2  # bf16 / fp16 weights and text embeddings

# ------------------------------------------------------------------------------ memory model

ADAMW_STATE_BYTES = 8  # AdamW's two fp32 moments per trained parameter (the step count is one scalar)
#: bytes autograd saves per token x hidden per block (averaged over the model's blocks), one sample,
#: one pass, checkpointing off, under bf16 autocast with a flash / memory-efficient attention (no
#: T x T scores; norms and softmax statistics in fp32): measured per family at real width by
#: benchmarks/memory.py (docs/scaling.md, "Memory model vs measurement"); a family not listed uses
#: ``CostParams.train_act_bytes``
ACT_BYTES_PER_TOKEN_HIDDEN: dict[str, float] = {
    "flux": 42.3,
    "wan": 51.5,
    "hunyuan_video": 44.2,
    "qwen_image": 64.9,
}
