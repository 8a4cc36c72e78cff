"""The run's per-iteration work, read from a RunConfig: model shape and parameter counts, steps,
groups, guidance passes, what travels between workers."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from digenrl.adapters import adapter_class
from digenrl.adapters.vae_decode import tiling_mode
from digenrl.algorithms.grpo import select_timesteps
from digenrl.config.algorithm import rollout_reference_refusal
from digenrl.planner.constants import (
    FP32_BYTES,
    FUNCTION_REWARDS,
    HALF_BYTES,
    HOST_REWARDS,
    MEASURED_REWARD_S,
    REMOTE_REWARDS,
)
from digenrl.planner.shapes import ModelShape, ParamCounts, forward_flops, model_shape, param_counts
from digenrl.planner.text_tokens import text_tokens
from digenrl.units.nft import is_forward_process, noise_levels


def measured_reward_s(name: str, height: int, width: int) -> float | None:
    """Seconds per image of a reward measured here (``MEASURED_REWARD_S``) at this image size: linear in
    the pixel count between the measured sides, proportional to it beyond them; None = unmeasured."""
    table = MEASURED_REWARD_S.get(name.split(":", 1)[0])
    if table is None:
        return None
    px = height * width
    (s0, t0), *rest = table
    if px <= s0 * s0:
        return t0
    for s1, t1 in rest:
        if px <= s1 * s1:
            return t0 + (t1 - t0) * (px - s0 * s0) / (s1 * s1 - s0 * s0)
        s0, t0 = s1, t1
    return t0 * px / (s0 * s0)


def reward_term_kind(name: str, server: str = "remote") -> str:
    """A reward component's kind for the cost model: "function" | "model" | "host" (a model on the
    scoring process's CPU: its time, no device weights) | "remote" (a judge served elsewhere; one
    served on the run's GPUs, ``server: cluster``, is a "model")."""
    kind = name.split(":", 1)[0]  # (rewards.reward_kind: ``kind:label``)
    if kind in FUNCTION_REWARDS:
        return "function"
    if kind in HOST_REWARDS:
        return "host"
    return "remote" if kind in REMOTE_REWARDS and server == "remote" else "model"


@dataclass(frozen=True)
class Workload:
    """The run's per-iteration work, from a RunConfig."""

    family: str
    shape: ModelShape
    params: ParamCounts
    steps: int  # N denoising steps per rollout
    trained_steps: int  # T trained-step positions per sample
    timestep_mode: str
    group_size: int
    prompts: int  # per iteration
    passes: int  # transformer passes per step (2 with two-pass CFG)
    kl: bool
    lora: bool
    micro_batch: int
    dtype_bytes: int
    reward_kind: str  # "weight_free" | "model" (a model reward or a remote judge)
    video_frames: int
    optimizer_steps: int = (
        1  # mini-batch PPO: train units per rolled-out unit and TSP rank, steps per iteration
    )
    weight_sync: str = (
        "broadcast"  # how rank 0 ships versions: "broadcast" (engine.weight_sync auto) | "object_store"
    )
    vae_tiled: bool = True  # the decode's memory is a tile of a sample (sampling.vae_tiling not off)
    video: bool = False  # a video family: the planner tries sequence parallelism
    evaluates: bool = False  # output.eval_every > 0 (the engine refuses sequence-parallel trainers then)
    # diffusion_nft: rollouts keep only the clean latent (no log-probs, one forward of the unit per step);
    # a train term (sample x noise level) is the old policy's no-grad forward + the current forward/backward
    forward_process: bool = False
    ema: bool = False  # train.ema: the trainer keeps an fp32 average of the trained weights
    # model.offload_text_encoders: the text encoders live on the CPU, on the device only while encoding
    text_offload: bool = False
    # algorithm.shared_prefix k: a group's first k rollout steps run once per group, not per sample
    shared_prefix: int = 0
    branch_tree: tuple = ()  # algorithm.branch_tree: later splits (step, factor)
    # samples per sampling forward of a rollout-only worker (engine.rollout_batch N); None = the trainer's
    # micro-batches (engine.rollout_batch "trainer", the bit-exact ratio), or with rollout_batch_auto
    # (engine.rollout_batch "auto") the largest each rollout device holds by the memory model
    rollout_batch: int | None = None
    rollout_batch_auto: bool = False
    # ... of a worker that also trains (colocated, TAG: engine.colocated_batch N); None = the trainer's
    # micro-batches, or with colocated_batch_auto ("auto") the whole unit on GPUs
    colocated_batch: int | None = None
    colocated_batch_auto: bool = False
    # each reward component: (kind, its configured seconds per image or None), kind "function" (a plain
    # function of the pixels, on the host), "model" (weights on the scoring device), "remote" (a judge
    # served elsewhere: the scoring worker only waits); () = one term of ``reward_kind``
    reward_terms: tuple[tuple[str, float | None], ...] = ()
    # the engine scores a rollout-only worker's units after them, beside its next unit (a model reward or a
    # remote judge and no reward.service: rewards.scored_after_unit in a disaggregated run)
    reward_after_unit: bool = False
    # where the KL reference runs (algorithm.kl_reference): train (also without a KL term or where rollout
    # cannot run) | rollout | auto (CostModel: rollout on GPU clusters, train on CPU ones)
    kl_reference: str = "train"
    # train.old_logprob recompute: a no-grad forward of each train forward's rows before it (the ratio's
    # behaviour log-prob from the trainer's own kernels; veRL-Omni's old_log_prob pass)
    old_logprob: bool = False

    @classmethod
    def from_config(cls, cfg) -> Workload:
        import torch

        adapter = adapter_class(cfg.model.adapter)
        shape = model_shape(cfg.model)
        trimmed = text_tokens(cfg)  # Qwen-Image: its prompts' tokens (trimmed forwards)
        if trimmed:
            shape.tokens, shape.text_source = replace(shape.tokens, text=trimmed[0]), trimmed[1]
        params = param_counts(shape, cfg.model.lora, adapter.default_lora_targets)
        ts, n = cfg.algorithm.timesteps, cfg.sampling.steps
        _, idx = select_timesteps(
            ts.mode,
            n,
            1,
            torch.Generator().manual_seed(0),
            fraction=ts.fraction,
            window=ts.window,
            shift_every=ts.window_shift_every,
        )
        h, w = cfg.model.height, cfg.model.width
        terms = tuple(
            (reward_term_kind(c.name, c.server), c.seconds_per_image or measured_reward_s(c.name, h, w))
            for c in cfg.reward.components
        )
        nft = is_forward_process(cfg)  # diffusion_nft, awm, online_dpo (costed as diffusion_nft's terms)
        if nft:  # K noise levels per sample take the place of the trained steps
            idx = torch.zeros(1, noise_levels(cfg))
        return cls(
            family=cfg.model.adapter,
            shape=shape,
            params=params,
            steps=n,
            trained_steps=idx.shape[1],
            timestep_mode=ts.mode,
            group_size=cfg.algorithm.group_size,
            prompts=cfg.train.prompts_per_iteration,
            passes=adapter.passes_for(shape.config, cfg.sampling.guidance),
            kl=cfg.algorithm.kl_beta > 0,
            lora=cfg.model.lora is not None,
            micro_batch=cfg.train.micro_batch,
            dtype_bytes=HALF_BYTES if cfg.model.dtype in ("bfloat16", "float16") else FP32_BYTES,
            reward_kind="weight_free" if all(k == "function" for k, _ in terms) else "model",
            video_frames=cfg.model.frames or 1,
            optimizer_steps=cfg.train.optimizer_steps,
            weight_sync="object_store" if cfg.engine.weight_sync == "object_store" else "broadcast",
            vae_tiled=tiling_mode(cfg.model, cfg.sampling) != "off",
            video=cfg.model.frames is not None,
            evaluates=cfg.output.eval_every > 0,
            forward_process=nft,
            ema=cfg.train.ema is not None,
            text_offload=cfg.model.offload_text_encoders,
            shared_prefix=cfg.algorithm.shared_prefix,
            branch_tree=tuple(tuple(t) for t in cfg.algorithm.branch_tree),
            rollout_batch=rb if isinstance(rb := cfg.engine.rollout_batch, int) else None,
            rollout_batch_auto=cfg.engine.rollout_batch == "auto",
            colocated_batch=cb if isinstance(cb := cfg.engine.colocated_batch, int) else None,
            colocated_batch_auto=cfg.engine.colocated_batch == "auto",
            reward_terms=terms,
            reward_after_unit=cfg.reward.service is None and any(k != "function" for k, _ in terms),
            kl_reference=_kl_reference(cfg),
            old_logprob=cfg.train.old_logprob == "recompute" and not nft,
        )

    @property
    def kl_at_rollout(self) -> bool:
        """The reference forward of each trained step runs in the rollout unit (resolved ``rollout``)."""
        return self.kl and self.kl_reference == "rollout"

    @property
    def kl_on_trainer(self) -> bool:
        """The train unit runs a reference forward per trained step."""
        return self.kl and not self.kl_at_rollout

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size

    def rollout_widths(self) -> list[int]:
        """Per rollout step, the rows one group runs: 1 on a shared prefix, a tree's nodes between its
        splits, G after the last split (G everywhere without a prefix)."""
        k, G = self.shared_prefix, self.group_size
        if not k:
            return [G] * self.steps
        tree = list(self.branch_tree)
        widths, width = [1] * k, 1
        splits = [(k, G // math.prod(f for _, f in tree)), *tree]
        for (step, factor), end in zip(splits, [s for s, _ in tree] + [self.steps]):
            width *= factor
            widths += [width] * (end - step)
        return widths

    @property
    def rollout_forwards(self) -> int:
        """Sample-forwards of one iteration's rollouts (per guidance pass): N per sample, less what a
        shared prefix (and a branch tree) saves: (G - 1) x k per group for one split."""
        return self.prompts * sum(self.rollout_widths())

    @property
    def rollout_flops(self) -> float:
        """The iteration's rollout transformer FLOPs (every guidance pass)."""
        return self.rollout_forwards * self.passes * forward_flops(self.shape)

    @property
    def trained_params(self) -> int:
        return self.params.lora if self.lora else self.params.total - self.params.frozen

    @property
    def sync_bytes(self) -> int:
        """What a weight sync ships: LoRA tensors in fp32, or every weight in the model dtype."""
        return self.params.lora * FP32_BYTES if self.lora else self.params.total * self.dtype_bytes

    @property
    def sample_bytes(self) -> int:
        """One rolled-out sample as it travels to a trainer: the latent trajectory (fp32), behaviour
        log-probs, its prompt conditioning, and (KL reference at rollout) a reference step mean per
        trained step (fp32)."""
        t = self.shape.tokens
        cond_dim = self.params.hidden  # order of the text embedding width
        if self.forward_process:  # diffusion_nft: the clean latent and K noise seeds
            return (
                t.latent_elements * FP32_BYTES
                + self.trained_steps * 8
                + self.passes * t.text * cond_dim * HALF_BYTES
            )
        return (
            (self.steps + 1) * t.latent_elements * FP32_BYTES
            + self.steps * FP32_BYTES
            + self.passes * t.text * cond_dim * HALF_BYTES
            + (self.trained_steps * t.latent_elements * FP32_BYTES if self.kl_at_rollout else 0)
        )

    @property
    def reward_weights(self) -> bool:
        """A reward model's weights sit on the scoring device (a remote judge's do not)."""
        if not self.reward_terms:
            return self.reward_kind == "model"
        kinds = {k for k, _ in self.reward_terms}
        return "model" in kinds or (self.reward_kind == "model" and kinds <= {"function"})

    def positions(self, rank: int, degree: int) -> int:
        return len(range(rank, self.trained_steps, degree))

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("shape")
        d["params"] = asdict(self.params)
        d["tokens"] = asdict(self.shape.tokens)
        d["shape_source"] = self.shape.source
        d["forward_tflops_per_sample"] = forward_flops(self.shape) / 1e12
        d["rollout_tflops"] = self.rollout_flops / 1e12
        return d


def _kl_reference(cfg) -> str:
    """``algorithm.kl_reference`` as the planner costs it (``auto`` left to the cluster's kind)."""
    value = cfg.algorithm.kl_reference
    if cfg.algorithm.kl_beta <= 0 or (value == "auto" and rollout_reference_refusal(cfg) is not None):
        return "train"
    return value
