"""The algorithm section and each algorithm's defaults (docs/algorithms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from digenrl.config.base import (
    MAX_BATCH,
    MAX_STEPS,
    _Section,
)
from digenrl.config.model import (
    TimestepConfig,
)

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
    # AWM and online DPO: forward-process like diffusion_nft -- clean ODE samples, no log-probs
    "awm": {
        "sde": "flow_grpo",
        "timesteps": {"mode": "fraction", "fraction": 0.99},
        "sampling": {"noise_level": 0.0},
    },
    "online_dpo": {
        "sde": "flow_grpo",
        "timesteps": {"mode": "fraction", "fraction": 0.99},
        "sampling": {"noise_level": 0.0},
    },
    # Flow-DPPO and GRPO-Guard: Flow-GRPO's SDE and trained steps, another trust region
    "flow_dppo": {"sde": "flow_grpo", "timesteps": {"mode": "fraction", "fraction": 0.99}},
    "grpo_guard": {"sde": "flow_grpo", "timesteps": {"mode": "fraction", "fraction": 0.99}},
}

#: the algorithms that train on forward-noised clean samples (no SDE log-probs travel)
FORWARD_PROCESS = ("diffusion_nft", "awm", "online_dpo")


#: families whose guidance is two-pass CFG: diffusion_nft rolls out and trains them CFG-free by default
TWO_PASS_CFG_FAMILIES = ("wan", "qwen_image", "sd3", "wan22", "qwen_image_edit")


def rollout_reference_refusal(cfg) -> str | None:
    """Why ``algorithm.kl_reference: rollout`` cannot run with ``cfg`` (None: it can). The sampler computes
    the reference at trained SDE steps: a Flow-GRPO-family loss, LoRA (the reference is the rollout
    worker's own base weights) and unbranched groups."""
    alg = cfg.algorithm
    if alg.name in FORWARD_PROCESS:
        return (
            f"needs a Flow-GRPO-family loss; algorithm.name {alg.name} trains on forward-noised samples "
            "and computes its reference in the train unit (use train or auto)"
        )
    if cfg.model.lora is None:
        return (
            "needs LoRA (model.lora): with full fine-tuning the rollout workers do not hold the "
            "reference weights (use train or auto)"
        )
    if alg.shared_prefix:
        return "does not run with algorithm.shared_prefix > 0 (branched groups; use train or auto)"
    return None


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
    if algorithm.get("name") in FORWARD_PROCESS and model.get("adapter") in TWO_PASS_CFG_FAMILIES:
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


class AwmConfig(_Section):
    """Advantage Weighted Matching's knobs (``algorithm.name: awm``; docs/algorithms.md)."""

    weighting: Literal["uniform", "t", "t2", "ghuber"] = Field(
        "ghuber", description="w(t, l) of the matching error l (Flow-Factory's SD3.5 recipe: ghuber)"
    )
    ghuber_power: float = Field(0.25, gt=0, le=1, description="p of the generalised Huber weighting")
    noise_levels: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="noised copies per sample (null: one per sampling step)"
    )


class DpoConfig(_Section):
    """Online DPO's knobs (``algorithm.name: online_dpo``; docs/algorithms.md)."""

    beta: float = Field(100.0, gt=0, description="DPO temperature on the error difference (flow_grpo: 100)")
    noise_levels: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="noised copies per pair (null: one per sampling step)"
    )


AlgorithmName = Literal[
    "flow_grpo", "dance_grpo", "diffusion_nft", "awm", "flow_dppo", "grpo_guard", "online_dpo"
]


class AlgorithmConfig(_Section):
    name: AlgorithmName = Field(
        "flow_grpo",
        description=(
            "selects the defaults of sampling.sde and algorithm.timesteps (see ALGORITHM_DEFAULTS); "
            "diffusion_nft / awm / online_dpo: forward-process RL on clean ODE samples; flow_dppo / "
            "grpo_guard: Flow-GRPO with a KL trust-region mask / a normalised ratio"
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
    kl_reference: Literal["auto", "train", "rollout"] = Field(
        "auto",
        description=(
            "where the KL reference's step mean (kl_beta > 0) is computed: train = a no-grad reference "
            "forward per trained step in the train unit; rollout = the sampler runs it at each sample's "
            "trained steps under the reference (LoRA off) and the samples carry it to the trainer "
            "(Flow-GRPO-family losses with LoRA only); auto = rollout on GPU pools where it applies, "
            "train elsewhere (CPU pools, local runs)"
        ),
    )
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
    awm: AwmConfig = Field(default_factory=AwmConfig, description="algorithm.name awm only")
    dpo: DpoConfig = Field(default_factory=DpoConfig, description="algorithm.name online_dpo only")
    shared_prefix: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="k > 0: a group's samples share their initial noise and first k (ODE) steps, computed "
        "once per group, and branch at step k (BranchGRPO); 0 = every sample its own",
    )
    branch_tree: list[tuple[int, int]] = Field(
        default_factory=list,
        description="later splits [step, factor] after shared_prefix (BranchGRPO's tree): the group splits "
        "at shared_prefix into G / prod(factors) branches, each of which splits into factor at step; "
        "[] = one split, into all G",
    )
    branch_advantages: Literal["leaf", "depth"] = Field(
        "leaf",
        description="with shared_prefix: leaf = each sample's group advantage at every step; depth = "
        "BranchGRPO's: a step's advantage is its tree node's (the mean of the node's leaves' rewards) "
        "normalised over the group's nodes at that depth (flow_grpo / dance_grpo / flow_dppo / grpo_guard)",
    )
    kl_mask_threshold: float = Field(
        1e-5, gt=0, description="flow_dppo: the trust region delta on the exact step KL (veRL-Omni: 1e-5)"
    )
