"""Evaluation: deterministic (ODE, noise level 0) sampling with fixed seeds, scored by every reward.

Details: docs/modules.md, `digenrl.run.evaluate`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from digenrl.algorithms.sde import sample
from digenrl.checkpoint.load import load_checkpoint, load_export, read_state, use_ema_weights
from digenrl.checkpoint.store import FULL_FILE, LORA_FILE, find_checkpoint, is_weights_export
from digenrl.config.run import load_config
from digenrl.config.train import PromptsConfig
from digenrl.data.prompts import Prompt, image_checks, load_prompts, prompt_char_limit, say_notes
from digenrl.errors import UserError
from digenrl.policy.model import Policy
from digenrl.rewards import build_reward
from digenrl.rewards.base import Decoded, score
from digenrl.run.media import save_samples
from digenrl.run.rundir import check_writable
from digenrl.units.rows import stream_seed


@dataclass
class EvalResult:
    prompts: list[str]
    pixels: torch.Tensor  # uint8, (N, 3, H, W) or (N, 3, F, H, W)
    scores: dict[str, torch.Tensor]  # reward component -> (N,)
    total: torch.Tensor  # (N,) weighted sum, as in training
    tags: list[str | None] | None = None  # each prompt's metadata ``tag`` (GenEval's task), if any

    def rewards(self) -> dict[str, dict]:
        """Per reward (and the weighted ``total``): mean, std and the per-prompt values. A NaN score
        (``reward.nan_policy: drop``) is left out of mean / std and written as null. Prompts with a
        metadata ``tag`` add ``by_tag`` (the mean per tag) and ``tag_mean`` (the mean of those: GenEval's
        overall score, as its ``summary_scores.py``)."""
        out = {}
        for name, v in {**self.scores, "total": self.total}.items():
            v = v.double()
            kept = v[~torch.isnan(v)]
            out[name] = {
                "mean": kept.mean().item() if len(kept) else None,
                "std": kept.std().item() if len(kept) > 1 else 0.0,
                "values": [None if x != x else round(x, 6) for x in v.tolist()],
            }
            if self.tags and any(self.tags):
                out[name].update(_by_tag(v, self.tags))
        return out

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat means for a metrics row: ``eval/<reward>`` per component and ``eval/reward_mean``."""
        return eval_metrics(self.total, self.scores, prefix)


def _by_tag(v: torch.Tensor, tags: list) -> dict:
    """Means of ``v`` per tag (NaN left out; an untagged prompt under "none") and their mean."""
    by = {}
    for tag in dict.fromkeys(str(t) if t else "none" for t in tags):
        rows = torch.tensor([(str(t) if t else "none") == tag for t in tags])
        kept = v[rows & ~torch.isnan(v)]
        by[tag] = kept.mean().item() if len(kept) else None
    means = [m for m in by.values() if m is not None]
    return {"by_tag": by, "tag_mean": sum(means) / len(means) if means else None}


def eval_metrics(total: torch.Tensor, parts: dict[str, torch.Tensor], prefix: str = "eval/") -> dict:
    """``eval/<reward>`` (each component's mean) and ``eval/reward_mean`` (the weighted total's), NaN
    scores left out: of an :class:`EvalResult`, or of the scores a rollout worker returned for a trainer
    rank's eval samples (the engine, a model reward: ``EngineWorker.evaluate``)."""
    row = {f"{prefix}{k}": v.float().nanmean().item() for k, v in parts.items()}
    row[f"{prefix}reward_mean"] = total.float().nanmean().item()
    return row


def eval_noise(adapter, index: int, seed: int) -> torch.Tensor:
    """Initial latents of eval prompt ``index``: the same for every policy evaluated with ``seed``."""

    return adapter.initial_noise(1, torch.Generator().manual_seed(stream_seed(seed, "eval", index)))


def evaluate_policy(policy, reward_fn, prompts: list[Prompt], **sampling) -> EvalResult:
    """:func:`eval_samples` of ``prompts`` (``sampling``: its keyword arguments), scored by ``reward_fn``."""
    decoded = eval_samples(policy, prompts, **sampling)
    scores = score(reward_fn, decoded)
    return EvalResult(
        prompts=decoded.prompts,
        pixels=(decoded.pixels * 255).round().to(torch.uint8),
        scores={k: v.float().cpu() for k, v in scores.parts.items()},
        total=scores.total.float().cpu(),
        tags=[p.meta.get("tag") for p in prompts],
    )


@torch.no_grad()
def eval_samples(
    policy,
    prompts: list[Prompt],
    *,
    steps: int | None = None,
    seed: int | None = None,
    batch_size: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Decoded:
    """ODE-sample one image / video per prompt with the policy's current weights, decoded (unscored).

    Defaults: ``sampling.eval_steps``, ``train.seed`` and ``train.micro_batch`` of the policy's config.
    ``on_batch(n)`` is called after each batch of ``n`` prompts. ``sampling.eval_guidance``, when set,
    replaces the guidance scale for the evaluation only.
    """
    cfg, ad = policy.cfg, policy.adapter
    steps = steps or cfg.sampling.eval_steps
    seed = cfg.train.seed if seed is None else seed
    batch_size = batch_size or cfg.train.micro_batch
    sigmas = ad.sigmas(steps)
    pixels = []
    guided = cfg.sampling.eval_guidance is not None and cfg.sampling.eval_guidance != ad.sampling.guidance
    train_sampling = ad.sampling
    if guided:  # sampling.eval_guidance: the evaluation's own guidance (e.g. CFG after CFG-free training)
        ad.sampling = ad.sampling.model_copy(update={"guidance": cfg.sampling.eval_guidance})
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            # encoded afresh with the eval guidance (a CFG family's conditioning holds the negative prompt)
            texts, images = [p.text for p in chunk], [p.meta.get("image") for p in chunk]
            if guided:
                cond = (ad.encode_prompts(texts, images) if ad.edits else ad.encode_prompts(texts)).to(
                    ad.device
                )
            else:
                cond = ad.cond_for(texts, images)  # through the prompt cache
            noise = torch.cat([eval_noise(ad, start + j, seed) for j in range(len(chunk))])
            traj = sample(ad, cond, noise.to(ad.device), sigmas, "flow_grpo", 0.0)  # eta 0: the Euler ODE
            pixels.append(ad.decode(traj.latents[:, -1]).clamp(0, 1).cpu())
            if on_batch:
                on_batch(len(chunk))
    finally:
        ad.sampling = train_sampling
    return Decoded(torch.cat(pixels), [p.text for p in prompts], [dict(p.meta) for p in prompts])


# ------------------------------------------------------------------------------------- digenrl eval
@dataclass
class EvalJob:
    """Everything ``digenrl eval`` checked before it starts sampling."""

    checkpoint: Path
    cfg: object  # RunConfig
    config_path: Path
    prompts: list[Prompt]
    baseline: str | Path | None  # None | "base" | a checkpoint directory
    out: Path


def default_out_dir(checkpoint: Path) -> Path:
    """RUN/eval/iter-NNNNNN for a checkpoint of a run directory (RUN/eval/final for its export), else
    CHECKPOINT/eval."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / "eval" / checkpoint.name
    if is_weights_export(checkpoint) and (checkpoint.parent / "config.yaml").is_file():
        return checkpoint.parent / "eval" / checkpoint.name  # RUN/final -> RUN/eval/final
    return checkpoint / "eval"


def prepare_eval(
    checkpoint: Path,
    config: Path | None = None,
    prompts: Path | None = None,
    baseline: str | None = None,
    out: Path | None = None,
) -> EvalJob:
    """Validate every input (checkpoint, config, prompts, baseline, output dir) before any work: UserError."""

    if checkpoint is None:
        raise UserError("--checkpoint: required (a checkpoint directory or a run directory)")
    ckpt, config_path = _checkpoint_and_config(Path(checkpoint), config)
    cfg = load_config(config_path)
    limit = prompt_char_limit(cfg.model.max_text_len)  # what the text encoder can use, as train checks
    notes: list[str] = []
    if prompts is not None:
        prompt_set = load_prompts(
            PromptsConfig(file=prompts), limit, "--prompts", "test", notes=notes, **image_checks(cfg)
        )
    else:  # a directory: its held-out split
        prompt_set = load_prompts(cfg.prompts, limit, split="test", notes=notes, **image_checks(cfg))
    say_notes(notes)
    base = None
    if baseline is not None:
        if baseline == "base":
            base = "base"
        else:
            try:
                base = find_checkpoint(Path(baseline))
                read_state(base)
            except UserError as exc:  # the option the user typed, not "checkpoint:"
                raise UserError(f"--baseline: {str(exc).removeprefix('checkpoint: ')}") from None
    out = Path(out) if out is not None else default_out_dir(ckpt)
    check_writable(out, "--out")
    return EvalJob(ckpt, cfg, config_path, prompt_set, base, out)


def _checkpoint_and_config(checkpoint: Path, config: Path | None) -> tuple[Path, Path]:
    """The checkpoint to evaluate and its config: a checkpoint, a run (its latest), or a weights
    export -- a run's ``final/`` (its config: the run's ``config.yaml``, else ``-c``) or the path of its
    ``.safetensors``."""
    if checkpoint.is_file() and checkpoint.name in (LORA_FILE, FULL_FILE):
        checkpoint = checkpoint.parent
    if is_weights_export(checkpoint):
        run_config = checkpoint.parent / "config.yaml"
        if config is None and not run_config.is_file():
            raise UserError(
                f"--config: {checkpoint} is a weights export without its run's config.yaml beside it: give "
                "the config it was trained with (-c)"
            )
        return checkpoint, Path(config) if config is not None else run_config
    ckpt = find_checkpoint(checkpoint)
    return ckpt, Path(config) if config is not None else read_state(ckpt).config_path


def evaluate_checkpoint(job: EvalJob, on_batch: Callable[[int], None] | None = None) -> dict:
    """Run ``digenrl eval``: sample + score the checkpoint (and baseline), write eval.json and grids."""

    t0 = time.perf_counter()
    cfg = job.cfg.model_copy(deep=True)
    cfg.algorithm.kl_beta = 0.0  # no frozen reference copy: eval never needs one
    reward = build_reward(cfg.reward)
    policy = Policy(cfg, trainable=False)  # the initial weights (LoRA: B = 0, i.e. the base model)
    run = lambda: evaluate_policy(policy, reward, job.prompts, on_batch=on_batch)  # noqa: E731
    base = run() if job.baseline == "base" else None
    if is_weights_export(job.checkpoint):  # final/: the weights as trained (the EMA's, with train.ema)
        load_export(job.checkpoint, policy)
        state, ema = None, None
    else:
        state = load_checkpoint(job.checkpoint, policy, optimizer=False, rng=False)
        ema = use_ema_weights(job.checkpoint, policy)  # train.ema: the averaged weights, when kept
    main = run()
    base_label = "base"
    if isinstance(job.baseline, Path):
        load_checkpoint(job.baseline, policy, optimizer=False, rng=False)
        use_ema_weights(job.baseline, policy)
        base, base_label = run(), job.baseline.name
    report = {
        "checkpoint": str(job.checkpoint),
        "iteration": state.iteration if state is not None else None,  # an export keeps no counters
        "version": state.version if state is not None else None,
        "config": str(job.config_path),
        "adapter": cfg.model.adapter,
        "eval_steps": cfg.sampling.eval_steps,
        "seed": cfg.train.seed,
        "prompts": main.prompts,
        "rewards": main.rewards(),
        "weights": "ema" if ema is not None else "trained",
    }
    if ema is not None:
        report["ema"] = ema
    files = _write_grids(job.out, main, base, base_label)
    if base is not None:
        report["baseline"] = {
            "source": "base" if job.baseline == "base" else str(job.baseline),
            "rewards": base.rewards(),
        }
        ours = main.rewards()
        report["difference"] = {
            k: None if None in (ours[k]["mean"], v["mean"]) else ours[k]["mean"] - v["mean"]
            for k, v in base.rewards().items()
        }
    report.update(files)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    _write_atomic(job.out / "eval.json", json.dumps(report, indent=1))
    return report


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_grids(out: Path, main: EvalResult, base: EvalResult | None, base_label: str) -> dict:
    """``eval.png`` (video: ``eval.gif``) with prompt + total reward captions; with a baseline also
    ``compare.png|gif``: checkpoint and baseline side by side, two pairs per row."""

    out.mkdir(parents=True, exist_ok=True)
    caps = [f"{p} {r:.2f}" for p, r in zip(main.prompts, main.total.tolist())]
    files = {"grid": save_samples(main.pixels, caps, out / "eval").name}
    if base is not None:
        pixels = torch.stack([main.pixels, base.pixels], dim=1).flatten(0, 1)  # ckpt_i, base_i, ...
        base_caps = [f"{base_label} {r:.2f}" for r in base.total.tolist()]
        pair_caps = [c for pair in zip(caps, base_caps) for c in pair]
        files["comparison"] = save_samples(pixels, pair_caps, out / "compare", group=2).name  # 2 pairs a row
    return files
