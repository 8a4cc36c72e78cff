"""RunConfig, the whole run, and how it is loaded: defaults <- YAML <- ``--set`` overrides.

The defaults *are* the default run (``configs/flux_tiny.yaml`` writes them out); unknown keys,
duplicate keys, non-finite numbers, absurd sizes and invalid values raise ``ConfigError`` naming
the dotted path.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from digenrl.config.algorithm import (
    AlgorithmConfig,
    algorithm_defaults,
    rollout_reference_refusal,
)
from digenrl.config.base import (
    ConfigError,
    _Section,
)
from digenrl.config.engine import ClusterConfig, EngineConfig, PlacementConfig
from digenrl.config.model import (
    ModelConfig,
    SamplingConfig,
)
from digenrl.config.train import (
    PromptsConfig,
    RewardConfig,
    TrainConfig,
)
from digenrl.config.yamlfile import parse_yaml, rebase_paths
from digenrl.errors import UserError


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
        if self.train.old_logprob == "recompute" and self.train.optimizer_steps > 1:
            raise ValueError(
                "train.old_logprob: recompute needs train.optimizer_steps 1 (the pass runs with the weights "
                f"that generated the samples, before any update; got {self.train.optimizer_steps} steps)"
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
        section = {"diffusion_nft": "nft", "awm": "awm", "online_dpo": "dpo"}.get(alg.name)
        k = getattr(alg, section).noise_levels if section else None
        if k is not None and k > steps:
            raise ValueError(
                f"algorithm.{section}.noise_levels ({k}) exceeds sampling.steps ({steps}): the noise levels "
                "are distinct sigmas of the rollout schedule"
            )
        k = alg.shared_prefix
        if k and (k >= steps or ts.mode == "random" or self.sampling.noise_level == 0):
            raise ValueError(
                f"algorithm.shared_prefix ({k}) needs stochastic steps after it: fewer than sampling.steps "
                f"({steps}), sampling.noise_level > 0 (else the branches are identical) and "
                "algorithm.timesteps.mode fraction or window (not random)"
            )
        first = math.floor(ts.window_range[0] * steps + 1e-9)  # a window's first possible step
        if k and ts.mode == "window" and first < k:
            raise ValueError(
                f"algorithm.shared_prefix ({k}): the window must start at or after the branch step "
                f"(algorithm.timesteps.window_range starts at step {first})"
            )
        tree = alg.branch_tree
        steps_in = [k, *(s for s, _ in tree)]
        factors = math.prod(f for _, f in tree)
        if tree and (
            not k
            or steps_in != sorted(set(steps_in))
            or steps_in[-1] >= steps
            or any(f < 2 for _, f in tree)
            or alg.group_size % factors
            or alg.group_size // factors < 2
            or self.engine.unit_samples is not None
        ):
            raise ValueError(
                f"algorithm.branch_tree {[list(t) for t in tree]}: needs algorithm.shared_prefix > 0, split "
                f"steps increasing after it and below sampling.steps ({steps}), factors >= 2 whose product "
                f"divides algorithm.group_size ({alg.group_size}) leaving >= 2 first branches, and whole "
                "groups per rollout unit (engine.unit_samples null)"
            )
        if alg.branch_advantages == "depth" and (not k or alg.name in ("diffusion_nft", "awm", "online_dpo")):
            raise ValueError(
                "algorithm.branch_advantages: depth needs a branched group (algorithm.shared_prefix > 0) "
                f"and a per-step loss ({alg.name} takes one advantage per sample)"
            )
        if alg.kl_reference == "rollout" and (why := rollout_reference_refusal(self)):
            raise ValueError(f"algorithm.kl_reference: rollout {why}")
        if alg.name == "grpo_guard" and self.sampling.sde == "cps":
            raise ValueError(
                "algorithm.name: grpo_guard normalises a Gaussian log-ratio; sampling.sde cps has none "
                "(use flow_grpo or dance_grpo)"
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
    """The defaults (= the tiny FLUX demo) <- the YAML file, if any <- overrides, validated; the
    file's relative input paths are read from its folder (:func:`rebase_paths`). Raises ConfigError
    naming the dotted path."""
    data = read_yaml(path) if path is not None else {}
    if path is not None:
        rebase_paths(data, path)  # the file's relative paths are read from its folder
    for assignment in overrides or []:
        apply_override(data, assignment)
    rebase_paths(data, None)  # --set's from the working directory
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
