"""RunConfig: one Pydantic v2 model describing a whole DigenRL run.

Load order: the model's defaults <- YAML file <- repeated ``--set dotted.key=value``. The defaults
*are* the default run (``digenrl train`` with no arguments: the tiny FLUX colour demo on the engine);
``configs/flux_tiny.yaml`` writes them out with comments. Unknown keys, duplicate keys, non-finite
numbers, absurd sizes and invalid values raise :class:`ConfigError` naming the dotted path.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from digenrl.adapters import ADAPTERS
from digenrl.errors import UserError
from digenrl.yamlfile import parse_yaml


class ConfigError(UserError):
    pass


def first_duplicate(names: list[str]) -> str | None:
    """The first name that appears more than once, or None."""
    seen: set[str] = set()
    for n in names:
        if n in seen:
            return n
        seen.add(n)
    return None


def on_off(value):
    """YAML reads a bare on / off as a boolean: back to the word."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


class _Section(BaseModel):
    # inf / nan in a float field is refused at validation, naming the field
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


#: upper bounds that catch a typo (an extra zero or three) before a run that would never finish
MAX_STEPS = 1000
MAX_PIXELS = 8192
MAX_BATCH = 4096

#: the tiny demo's LoRA targets: attention + the pooled-text / output-modulation path, so a tiny
#: model can map a colour word to a global colour shift (real-scale configs list the standard
#: attention / FFN modules of their family)
TINY_FLUX_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "text_embedder.linear_1",
    "text_embedder.linear_2",
    "norm_out.linear",
    "proj_out",
]


# --------------------------------------------------------------------------------------- model
class LoraConfig(_Section):
    rank: int = Field(8, gt=0, le=MAX_BATCH)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] | None = Field(
        default_factory=lambda: list(TINY_FLUX_LORA_TARGETS),
        description=(
            "module-name suffixes (default: the tiny FLUX demo's); null = the adapter's default list"
        ),
    )
    init_seed: int = 0


class ModelConfig(_Section):
    adapter: str = "flux"
    preset: str | None = Field(
        "tiny", description="tiny random-init preset of the real classes (no download)"
    )
    pretrained: Path | None = Field(None, description="local diffusers checkpoint directory")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    height: int = Field(32, gt=0, le=MAX_PIXELS)
    width: int = Field(32, gt=0, le=MAX_PIXELS)
    frames: int | None = Field(None, gt=0, le=MAX_STEPS, description="video models only")
    lora: LoraConfig | None = Field(default_factory=LoraConfig, description="null = full fine-tuning")
    max_text_len: int = Field(16, gt=0, le=MAX_BATCH)
    prompt_cache: int = Field(
        512,
        ge=0,
        description="distinct prompts whose embeddings a worker keeps "
        "(each encoded once per run, kept on the CPU); 0 = encode every time",
    )
    offload_text_encoders: bool = Field(
        False,
        description="a checkpoint's text encoders stay on the CPU and "
        "move to the device only to encode prompts",
    )

    @field_validator("adapter")
    @classmethod
    def _known_adapter(cls, name: str) -> str:
        if name not in ADAPTERS:
            raise ValueError(f"unknown adapter '{name}' (available: {', '.join(sorted(ADAPTERS))})")
        return name

    @model_validator(mode="before")
    @classmethod
    def _pretrained_replaces_preset(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("pretrained") is not None
            and data.get("preset", "tiny") == "tiny"
        ):
            data = {**data, "preset": None}  # a checkpoint replaces the default tiny preset
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.preset is None) == (self.pretrained is None):
            raise ValueError(
                "set exactly one of model.preset (tiny, random init) or model.pretrained (local path)"
            )
        return self


# ------------------------------------------------------------------------------------ sampling
class SamplingConfig(_Section):
    steps: int = Field(8, gt=0, le=MAX_STEPS, description="denoising steps during RL rollouts")
    eval_steps: int = Field(16, gt=0, le=MAX_STEPS)
    shift: float | None = Field(
        None, gt=0, description="fixed sigma shift; None = the model's own (FLUX/Qwen: dynamic mu)"
    )
    guidance: float = Field(3.5, ge=0, description="guidance scale in the model's own style")
    eval_guidance: float | None = Field(
        None,
        ge=0,
        description="guidance scale of evaluation only (null: sampling.guidance); e.g. CFG at eval after "
        "CFG-free diffusion_nft training",
    )
    negative_prompt: str = ""
    sde: Literal["flow_grpo", "dance_grpo", "cps"] = "flow_grpo"
    noise_level: float = Field(1.0, ge=0, description="eta; 0 = deterministic ODE (Euler) sampling")
    cfg_batching: Literal["auto", "batched", "sequential"] = Field(
        "auto",
        description=(
            "two-pass CFG (Wan, Qwen-Image): batched = one forward of 2B (training holds both passes' "
            "activations); sequential = two forwards of B (training backpropagates one pass at a time); auto "
            "= batched where the memory model says it fits the device, else sequential (sequential on "
            "devices of unknown memory)"
        ),
    )
    vae_tiling: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "decode with the VAE's spatial (and, HunyuanVideo, temporal) tiles; auto = on when one decoded "
            "sample (height x width x frames) exceeds the memory model's tile (4 Mpx). Decoding is always "
            "one sample at a time"
        ),
    )

    @field_validator("vae_tiling", mode="before")
    @classmethod
    def _switch(cls, value):
        return on_off(value)


# ----------------------------------------------------------------------------------- algorithm
class TimestepConfig(_Section):
    mode: Literal["fraction", "random", "window"] = "fraction"
    fraction: float = Field(
        0.99, gt=0, le=1, description="fraction: first floor(N*f) steps; random: floor((N-1)*f) per sample"
    )
    window: int = Field(
        2, gt=0, le=MAX_STEPS, description="window mode: SDE steps per trajectory (ODE elsewhere)"
    )
    window_shift_every: int = Field(
        0,
        ge=0,
        description="0 = random window start (Flow-GRPO-Fast); K = slide by one every K iterations (MixGRPO)",
    )
    window_range: tuple[float, float] = Field(
        (0.0, 0.5),
        description=(
            "window mode: [start, end) as fractions of sampling.steps that the window stays inside; "
            "(0, 0.5) = the first half, as flow_grpo-Fast's (0, N//2); the last step is never inside"
        ),
    )

    @field_validator("window_range")
    @classmethod
    def _ordered_fractions(cls, r: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= r[0] < r[1] <= 1:
            raise ValueError(
                f"must be [start, end] fractions of the steps with 0 <= start < end <= 1 (got {list(r)})"
            )
        return r


#: what ``algorithm.name`` selects: the defaults of the algorithm's own choices, each of which a
#: config may still set explicitly (e.g. DanceGRPO's timestep subset with Flow-GRPO's SDE)
ALGORITHM_DEFAULTS = {
    # Flow-GRPO: its SDE; train steps 0..T-1 in order, T = floor(0.99 N)
    "flow_grpo": {"sde": "flow_grpo", "timesteps": {"mode": "fraction", "fraction": 0.99}},
    # DanceGRPO: its SDE; drop the last step, shuffle, train floor(0.6 (N-1)) per sample
    "dance_grpo": {"sde": "dance_grpo", "timesteps": {"mode": "random", "fraction": 0.6}},
    # DiffusionNFT: no SDE and no trained steps -- rollouts are the deterministic ODE at the paper's 10
    # steps; training draws algorithm.nft.noise_levels forward-noised copies of each clean sample
    "diffusion_nft": {
        "sde": "flow_grpo",
        "timesteps": {"mode": "fraction", "fraction": 0.99},
        "sampling": {"noise_level": 0.0, "steps": 10},
    },
}


#: families whose guidance is two-pass CFG: diffusion_nft rolls out and trains them CFG-free by default
TWO_PASS_CFG_FAMILIES = ("wan", "qwen_image")


def algorithm_defaults(data: dict) -> dict:
    """``data`` (a raw config mapping) with the keys ``algorithm.name`` selects filled in where unset."""
    algorithm = data.get("algorithm", {})
    if (
        not isinstance(algorithm, dict)
        or not isinstance(data.get("sampling", {}), dict)
        or not isinstance(algorithm.get("timesteps", {}), dict)
    ):
        return data  # not a mapping: validation names the field
    preset = ALGORITHM_DEFAULTS.get(algorithm.get("name", "flow_grpo"))
    if preset is None:  # an unknown name: validation names it
        return data
    timesteps = {"mode": preset["timesteps"]["mode"], **(algorithm.get("timesteps") or {})}
    if timesteps["mode"] == preset["timesteps"]["mode"]:
        timesteps = {"fraction": preset["timesteps"]["fraction"], **timesteps}
    sampling = dict(preset.get("sampling", {}))
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if algorithm.get("name") == "diffusion_nft" and model.get("adapter") in TWO_PASS_CFG_FAMILIES:
        sampling["guidance"] = 1.0  # CFG-free rollouts and training (sampling.eval_guidance: CFG at eval)
    return {
        **data,
        "sampling": {"sde": preset["sde"], **sampling, **(data.get("sampling") or {})},
        "algorithm": {**algorithm, "timesteps": timesteps},
    }


class NftConfig(_Section):
    """DiffusionNFT's own knobs (``algorithm.name: diffusion_nft``; docs/algorithms.md)."""

    beta: float = Field(
        1.0,
        gt=0,
        description="v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v (paper: 1; OCR 0.1)",
    )
    noise_levels: int | None = Field(
        None,
        gt=0,
        le=MAX_STEPS,
        description="K forward-noised copies per sample, at K distinct sigmas of the rollout schedule "
        "drawn per sample; null = all sampling.steps of them (the reference's timestep_fraction 1)",
    )
    decay_flat: int = Field(0, ge=0, description="old-policy EMA: decay 0 for the first N optimizer steps")
    decay_rate: float = Field(
        0.001, ge=0, description="old-policy EMA: decay rises by this per optimizer step"
    )
    decay_max: float = Field(
        0.5, ge=0, lt=1, description="old-policy EMA: decay cap (the reference's decay_type 1: 0, 0.001, 0.5)"
    )


class AlgorithmConfig(_Section):
    name: Literal["flow_grpo", "dance_grpo", "diffusion_nft"] = Field(
        "flow_grpo",
        description=(
            "selects the defaults of sampling.sde and algorithm.timesteps (see ALGORITHM_DEFAULTS); "
            "diffusion_nft: forward-process RL on clean ODE samples (algorithm.nft)"
        ),
    )
    group_size: int = Field(
        8, ge=2, le=MAX_BATCH, description="G samples per prompt; 1 would leave no advantage"
    )
    clip_range: float | None = Field(
        None, gt=0, description="PPO clip; null = by sampling.sde: cps 1e-5, else 1e-4"
    )
    adv_clip: float = Field(5.0, gt=0)
    std: Literal["per_prompt", "global"] = "per_prompt"
    std_ddof: Literal[0, 1] = Field(
        0,
        description=(
            "advantage std: 0 = population std (flow_grpo), 1 = sample std (DanceGRPO; advantages "
            "sqrt((G-1)/G) smaller)"
        ),
    )
    kl_beta: float = Field(0.0, ge=0)
    is_cap: float = Field(
        2.0, ge=1, description="cap of the importance weight for stale samples (decoupled PPO)"
    )
    stale_gradient: Literal["recentred", "raw"] = Field(
        "recentred",
        description=(
            "stale samples' log-prob gradient: recentred = their recorded step noise around the current "
            "mean (the on-policy score, no stale drift term); raw = the recorded sample as is"
        ),
    )
    timesteps: TimestepConfig = Field(default_factory=TimestepConfig)
    nft: NftConfig = Field(default_factory=NftConfig, description="algorithm.name diffusion_nft only")


# -------------------------------------------------------------------------------------- reward
class RewardTerm(_Section):
    name: str
    weight: float = Field(1.0, description="0 = logged only (reward/<name>), not trained on")
    args: dict[str, Any] = Field(default_factory=dict, description="the reward's own arguments")
    seconds_per_image: float | None = Field(
        None,
        gt=0,
        description=(
            "for `digenrl plan` only: seconds this reward takes per image (per scored frame of a video) -- "
            "a remote judge's latency, or a model reward measured on its device; null = the planner's "
            "default for its kind"
        ),
    )


class RewardServiceConfig(_Section):
    """The reward actor's own Ray resource request (engine placements only; local runs score inline)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0, description="> 0: the reward models go on a GPU of the cluster")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources, e.g. a GPU type"
    )


class RewardConfig(_Section):
    components: list[RewardTerm] = Field(
        default_factory=lambda: [RewardTerm(name="prompt_color")], min_length=1
    )
    combine: Literal["weighted_sum", "per_reward_advantage"] = Field(
        "weighted_sum",
        description="advantages of the weighted sum, or the weighted sum of per-reward advantages",
    )
    nan_policy: Literal["fail", "drop"] = Field("fail", description="drop: NaN samples get advantage 0")
    service: RewardServiceConfig | None = Field(
        None, description="null = rewards run inside the rollout worker"
    )

    @field_validator("components")
    @classmethod
    def _unique_names(cls, terms: list[RewardTerm]) -> list[RewardTerm]:
        dup = first_duplicate([t.name for t in terms])
        if dup is not None:
            raise ValueError(
                f"reward '{dup}' is listed twice (each reward is logged and weighted by its name)"
            )
        if all(t.weight == 0 for t in terms):  # weight 0 = logged only: nothing would be trained on
            raise ValueError(
                "every reward weight is 0, so the run would learn nothing (a weight of 0 only logs "
                "reward/<name>); give at least one reward a non-zero weight"
            )
        return terms


# ------------------------------------------------------------------------------------- prompts
class PromptsConfig(_Section):
    builtin: str | None = Field("colors", description="built-in prompt set")
    file: Path | None = Field(None, description="one prompt per line (.txt) or JSONL with a 'prompt' field")

    @model_validator(mode="before")
    @classmethod
    def _file_replaces_builtin(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("file") is not None
            and data.get("builtin", "colors") == "colors"
        ):
            data = {**data, "builtin": None}  # a file replaces the default built-in set
        return data

    @model_validator(mode="after")
    def _one_source(self) -> PromptsConfig:
        if (self.builtin is None) == (self.file is None):
            raise ValueError("set exactly one of prompts.builtin or prompts.file")
        return self


# --------------------------------------------------------------------------------------- train
class EmaConfig(_Section):
    """An exponential moving average of the trained weights, for eval and export (flow_grpo's
    ``train.ema``)."""

    decay: float = Field(0.9, gt=0, lt=1, description="the average's decay per update (flow_grpo: 0.9)")
    every: int = Field(1, gt=0, description="update after every N-th optimizer step (flow_grpo: 8)")
    warmup: bool = Field(
        True,
        description="decay min(decay, (1 + n) / (10 + n)) at the n-th optimizer step, "
        "as flow_grpo; false: always `decay`",
    )


class TrainConfig(_Section):
    iterations: int = Field(180, gt=0, le=10_000_000)
    prompts_per_iteration: int = Field(4, gt=0, le=MAX_BATCH)
    micro_batch: int = Field(
        16, gt=0, le=MAX_BATCH, description="samples per forward/backward inside a train unit"
    )
    # 3e-3: the demo (colocated, on-policy) learns well with it, and so does one-step async (samples one
    # version old, decoupled PPO), which overshot and collapsed late in some runs at 5e-3
    # (docs/algorithms.md, "Stale samples: the step size")
    lr: float = Field(3e-3, gt=0, lt=10)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(1e-4, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    optimizer_steps: int = Field(
        1,
        gt=0,
        description="mini-batch PPO: optimizer steps per iteration, step s over "
        "the s-th equal slice of every prompt group's samples",
    )
    ema: EmaConfig | None = Field(
        None, description="EMA of the trained weights for eval and final/ (off: null)"
    )
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        "auto",
        description="recompute each transformer block in backward; auto = as the memory preflight "
        "resolves it (off on CPU)",
    )
    fsdp: Literal["auto", "off"] | int = Field(
        "auto",
        description=(
            "FSDP2 sharding degree of the trainer ranks: auto | off | N (N = all trainer ranks of a "
            "disaggregated engine run); auto = as the memory preflight resolves it"
        ),
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _switch(cls, value):
        return on_off(value)

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_degree(cls, value):
        if value is False:  # YAML reads a bare off as false
            return "off"
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        if value in ("auto", "off"):
            return value
        raise ValueError(f"must be auto, off or a sharding degree >= 1, got {value!r}")


# ----------------------------------------------------------------------- cluster / placement / engine
class PoolConfig(_Section):
    """A pool of devices of one type: the one pool type of run configs, cluster files and plans
    (:mod:`digenrl.placement`). Frozen: plans hash it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="1-64 letters, digits, _ . - (it names Ray resources and timeline rows)")
    device: str = Field("cpu", description="device type: cpu (logical) or a GPU name such as H800, H20, A100")
    count: int = Field(1, gt=0)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise ValueError(f"a pool name is 1-64 letters, digits, '_', '.' or '-' (got {shown!r})")
        return name


class ClusterConfig(_Section):
    pools: list[PoolConfig] = Field(
        default_factory=lambda: [
            PoolConfig(name="rollout", device="cpu"),
            PoolConfig(name="trainer", device="cpu"),
        ],
        min_length=1,
    )


class PlacementConfig(_Section):
    mode: Literal["local", "colocated", "disaggregated"] = Field(
        "colocated", description="local = one process, no Ray; colocated / disaggregated = the engine"
    )
    rollout_pool: str = "rollout"
    trainer_pool: str = "trainer"


class FaultConfig(_Section):
    worker: str = Field(description="worker name, e.g. rollout0 (pool name + index) or reward")
    unit: str = Field(
        description=(
            "unit uid, e.g. rollout-2-0 (iteration 2, unit 0) or train-1-0-0: the process dies after the "
            "unit's work; <uid>:start on a sequence-parallel or sharded group's follower: as its share "
            "starts, while its lead waits in the unit's collectives; sync-<version> on "
            "trainer rank 0 corrupts that version's broadcast weight sync in transit instead"
        )
    )


class EngineConfig(_Section):
    unit_groups: int = Field(1, gt=0, description="GAP unit size: prompt groups per rollout unit")
    unit_samples: int | None = Field(
        None,
        gt=0,
        description=(
            "sub-group units: samples per rollout unit, a divisor of algorithm.group_size (a unit holds part "
            "of one group; the group trains once all its parts are scored). Unset: engine.unit_groups whole "
            "groups per unit, except colocated, where groups are split automatically when they are fewer "
            "than the devices"
        ),
    )
    gap: bool = Field(
        False, description="GAP (disaggregated): train each rollout unit as soon as it is scored"
    )
    tsp_degree: int = Field(
        1, gt=0, le=MAX_STEPS, description="TSP: trained timesteps split over this many ranks"
    )
    tag: bool = Field(False, description="TAG (disaggregated): an idle trainer rank rolls out a pending unit")
    rollout_sp: int = Field(1, gt=0, description="sequence parallelism: devices per rollout worker (Ulysses)")
    trainer_sp: int = Field(1, gt=0, description="sequence parallelism: devices per trainer rank (Ulysses)")
    max_staleness: Literal[0, 1] = Field(
        0, description="1 = one-step async (disaggregated only): rollout k+1 with version k"
    )
    max_restarts: int = Field(
        3, ge=0, description="restarts per rollout worker / reward actor before the run stops"
    )
    trainer_restarts: int = Field(
        0,
        ge=0,
        description=(
            "a dead trainer rank (or member of a trainer group): restart every worker from the last "
            "checkpoint, up to this many times (0: the run stops with a resume hint)"
        ),
    )
    weight_sync: Literal["auto", "broadcast", "object_store"] = Field(
        "auto",
        description=(
            "how trainer rank 0 ships each new version to the rollout workers: broadcast = a "
            "torch.distributed group (gloo on CPU, NCCL on GPU), bucketed, received while the worker "
            "generates; object_store = the Ray object store; auto = broadcast when the group forms, else the "
            "object store"
        ),
    )
    rollout_batch: Literal["auto", "trainer"] | int = Field(
        "auto",
        description=(
            "samples per sampling forward of a rollout-only worker: trainer = the train forwards' "
            "batches (on-policy ratio exactly 1); N = N per forward (the ratio 1 to rounding, see "
            "logprob_mismatch); auto = the largest the rollout device holds by the memory model "
            "(trainer on devices of unknown memory: CPU pools, untyped GPUs). TAG trainer ranks and "
            "colocated workers always forward in the trainer's batches"
        ),
    )
    compile_rollout: Literal["off", "on"] = Field(
        "off", description="torch.compile the rollout workers' transformer (engine.compile_mode)"
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode of engine.compile_rollout (CUDA graphs: reduce-overhead)"
    )
    faults: list[FaultConfig] = Field(
        default_factory=list,
        description=(
            "fault injection (tests, soak): `worker`'s process exits after the work of `unit`, once per run "
            "(a plugin in the worker processes, digenrl/faults.py); also DIGENRL_FAULTS=worker@unit,..."
        ),
    )

    @field_validator("compile_rollout", mode="before")
    @classmethod
    def _switch(cls, value):
        return on_off(value)

    @field_validator("rollout_batch", mode="before")
    @classmethod
    def _rollout_batch(cls, value):
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_BATCH:
            return value
        if value in ("auto", "trainer"):
            return value
        raise ValueError(f"must be auto, trainer or a batch size 1..{MAX_BATCH}, got {value!r}")


# -------------------------------------------------------------------------------------- output
class OutputConfig(_Section):
    run_dir: Path | None = Field(None, description="default runs/<name>-<timestamp>")
    name: str = Field(
        "flux-tiny", description="a plain name (no path): the run goes to runs/<name>-<timestamp>"
    )
    checkpoint_every: int = Field(
        20, ge=0, description="every N iterations (and the last); 0 = only at the end"
    )
    keep_last: int = Field(3, gt=0)
    save_samples_every: int = Field(30, ge=0, description="0 = never")
    eval_every: int = Field(0, ge=0)
    tensorboard: bool = True
    wandb: bool = Field(False, description="also log to Weights & Biases (needs the wandb package)")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if len(name.encode()) > 200:  # a file name: runs/<name>-<time> must stay under 255 bytes
            raise ValueError(f"must be a name of at most 200 bytes (got {len(name.encode())})")
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(
                f"must be a plain name without '/' or '..' (got {name!r}); set output.run_dir "
                "or --run-dir for another place"
            )
        return name


class RunConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="before")
    @classmethod
    def _algorithm_selects_defaults(cls, data: Any) -> Any:
        return algorithm_defaults(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        if self.train.prompts_per_iteration % self.engine.unit_groups:
            raise ValueError(
                f"engine.unit_groups ({self.engine.unit_groups}) must divide train.prompts_per_iteration "
                f"({self.train.prompts_per_iteration}) into whole groups per unit"
            )
        if self.algorithm.group_size % self.train.optimizer_steps:
            raise ValueError(
                f"train.optimizer_steps ({self.train.optimizer_steps}) must divide algorithm.group_size "
                f"({self.algorithm.group_size}): each mini-batch holds an equal slice of every group"
            )
        s, G = self.engine.unit_samples, self.algorithm.group_size
        if s is not None and G % s:
            raise ValueError(f"engine.unit_samples ({s}) must divide algorithm.group_size ({G})")
        if s is not None and self.engine.unit_groups != 1:
            raise ValueError(
                f"engine.unit_samples ({s}) needs engine.unit_groups 1 (a unit holds part of one "
                f"group), got {self.engine.unit_groups}"
            )
        if self.placement.mode == "colocated" and self.engine.max_staleness:
            raise ValueError(
                f"engine.max_staleness ({self.engine.max_staleness}, one-step async) needs placement.mode "
                "disaggregated: colocated devices cannot roll out while they train (the demo on the full "
                "mode: -c configs/flux_tiny_disaggregated.yaml)"
            )
        self._algorithm_defaults()
        if self.placement.mode != "local":
            names = [p.name for p in self.cluster.pools]
            for key in ("rollout_pool", "trainer_pool"):
                pool = getattr(self.placement, key)
                if pool not in names:
                    raise ValueError(f"placement.{key} '{pool}' is not a pool of cluster.pools {names}")
        return self

    def _algorithm_defaults(self) -> None:
        """Per-sampler clip range (when not set) and a window range that holds the window."""
        from digenrl.algorithms.grpo import default_clip_range, window_bounds

        alg, ts, steps = self.algorithm, self.algorithm.timesteps, self.sampling.steps
        if alg.clip_range is None:
            alg.clip_range = default_clip_range(self.sampling.sde)
        k = alg.nft.noise_levels
        if alg.name == "diffusion_nft" and k is not None and k > steps:
            raise ValueError(
                f"algorithm.nft.noise_levels ({k}) exceeds sampling.steps ({steps}): the noise levels are "
                "distinct sigmas of the rollout schedule"
            )
        if ts.mode == "window" and window_bounds(steps, ts.window, ts.window_range) is None:
            raise ValueError(
                f"algorithm.timesteps.window_range {list(ts.window_range)} of sampling.steps ({steps}) holds "
                f"fewer than algorithm.timesteps.window ({ts.window}) steps (the last step is never in a "
                "window)"
            )

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------------------- loading
def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    path = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] != "value_error" and "input" in first and not isinstance(first["input"], (dict, list)):
        msg = f"{msg} (got {first['input']!r})"
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{path}: {msg}{more}"


def apply_override(data: dict, assignment: str) -> None:
    """Apply one ``dotted.key=value`` in place; the value is parsed as a YAML scalar/list."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected dotted.key=value")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r}: empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value is not valid YAML ({exc.__class__.__name__})") from None
    node: Any = data
    default: Any = RunConfig().model_dump(mode="json")  # where an index reaches into a default list
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[_index(node, part, parts[: i + 1])]
            default = None
            continue
        if not isinstance(node.get(part, {}), (dict, list)) and node.get(part) is not None:
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, not a section")
        default = default.get(part) if isinstance(default, dict) else None
        if node.get(part) is None:
            # a list is copied from the defaults (reward.components.0.weight=2); a section starts empty so
            # that what algorithm.name selects still fills the keys left unset
            node[part] = copy.deepcopy(default) if isinstance(default, list) else {}
        node = node[part]
    if isinstance(node, list):
        node[_index(node, parts[-1], parts)] = value
    else:
        node[parts[-1]] = value


def _index(node: list, part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"{'.'.join(path)}: no list element {part!r} (list has {len(node)})")
    return int(part)


def read_yaml(path: Path) -> dict:
    """A run config file as a mapping; an empty (or ``null``) file is ``{}``: the defaults."""
    path = Path(path)
    if not path.is_file() and not path.is_dir():
        raise ConfigError(f"{path}: config file not found")

    try:
        data = parse_yaml(path, "--config")
    except UserError as exc:
        raise ConfigError(str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The defaults (= the tiny FLUX demo) <- the YAML file, if any <- overrides, validated.
    Raises ConfigError naming the dotted path."""
    data = read_yaml(path) if path is not None else {}
    for assignment in overrides or []:
        apply_override(data, assignment)
    try:
        return validate_config(data)
    except ConfigError as exc:
        if path is None or _from_overrides(str(exc), overrides or []):
            raise
        raise ConfigError(f"{path}: {exc}") from None  # the file holds the bad key or value


def _from_overrides(message: str, overrides: list[str]) -> bool:
    """Whether a validation error names a key that a ``--set`` assigned (else it came from the file)."""
    key = message.split(":", 1)[0].split(" ", 1)[0]
    for assigned in (a.split("=", 1)[0].strip() for a in overrides):
        if (key == "config" and assigned in message) or assigned.startswith(key) or key.startswith(assigned):
            return True
    return False


def validate_config(data: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
