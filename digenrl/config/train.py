"""The reward, prompt-set, EMA and training sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from digenrl.config.base import (
    MAX_BATCH,
    _Section,
    first_duplicate,
    on_off,
)

# -------------------------------------------------------------------------------------- reward
#: rewards whose model runs elsewhere (a judge or detector service): the scoring worker only waits
REMOTE_REWARDS = frozenset({"remote", "geneval", "vlm_judge"})
#: rewards that are plain functions of the pixels (digenrl/rewards/basic.py; no model weights, CPU time
#: per image only): every other one is a model or a remote judge's client. Named here, where both the
#: runtime (rewards.scored_after_unit) and the planner (its "function" cost kind) read it.
FUNCTION_REWARDS = frozenset(
    {
        "prompt_color",
        "prompt_shape",
        "smallworld",
        "source_similarity",
        "jpeg_compressibility",
        "jpeg_incompressibility",
    }
)


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
    server: Literal["remote", "cluster"] = Field(
        "remote",
        description=(
            "for `digenrl plan` only, a judge's (remote, geneval, vlm_judge): remote = its server runs off "
            "the cluster's GPUs (the scoring worker waits); cluster = on the run's own GPUs beside it "
            "(e.g. vLLM sharing them), costed as a model reward: its seconds and weights on the device"
        ),
    )

    @model_validator(mode="after")
    def _server_is_a_judges(self) -> RewardTerm:
        if self.server == "cluster" and self.name.split(":", 1)[0] not in REMOTE_REWARDS:
            raise ValueError(
                "server: cluster is for a judge served beside the run "
                f"({', '.join(sorted(REMOTE_REWARDS))}); '{self.name}' runs in the scoring process"
            )
        return self


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
    pair_batch: int | None = Field(
        None,
        gt=0,
        le=MAX_BATCH,
        description=(
            "timestep-pair train batches: a train unit's (sample, trained step) pairs in forwards of this "
            "many rows, each row at its own timestep (fewer, larger forwards than one per step; the "
            "gradient is the same); the behaviour log-prob is then recomputed to rounding only "
            "(logprob_mismatch). null: one forward per trained step and micro-batch (ratio exactly 1)"
        ),
    )
    old_logprob: Literal["rollout", "recompute"] = Field(
        "rollout",
        description=(
            "the PPO ratio's behaviour log-prob: rollout = as the rollout recorded it (a train forward "
            "reproduces it exactly only in the rollout's own batches; to rounding in pair batches, "
            "logprob_mismatch); recompute = first a no-grad forward of each train forward's own rows "
            "(veRL-Omni's old_log_prob pass): the first update's ratio exactly 1, one more forward "
            "each, priced by the planner; needs train.optimizer_steps 1"
        ),
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
