"""The single-process driver (``placement.mode: local``): the algorithm, one iteration at a time.

    for each iteration:
        sample prompts -> rollout units (generate, decode, score) -> group advantages
        -> train units (accumulate gradients) -> one optimizer step -> log
        [-> eval every output.eval_every] [-> checkpoint every output.checkpoint_every]

Resume (``LocalTrainer(cfg, resume=RUN_OR_CHECKPOINT)``) is exact: the randomness of iteration k
is derived from (seed, k, group) and the prompts of k from (seed, k), so restoring weights,
optimizer state, version and RNG states reproduces the uninterrupted run iteration for iteration.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from digenrl.checkpoint import CheckpointState, find_checkpoint, load_checkpoint, save_checkpoint
from digenrl.config import RunConfig
from digenrl.lora import save_lora
from digenrl.policy import Policy
from digenrl.prompts import PromptSampler, load_prompts
from digenrl.rewards import build_reward, reward_metrics
from digenrl.runlog import RunDir
from digenrl.units import Samples, assign_advantages, merge_stats, preflight_reward, rollout_unit, train_unit


@dataclass
class RunResult:
    run_dir: Path
    metrics: list[dict]


class LocalTrainer:
    """Everything in this process: one policy that both samples and trains."""

    def __init__(self, cfg: RunConfig, resume: Path | None = None):
        """``resume``: a run directory (its latest complete checkpoint) or a checkpoint directory."""
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        # build (and so validate) everything before anything is written
        self.prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed)
        self.reward = build_reward(cfg.reward)
        self.policy = Policy(cfg)
        preflight_reward(self.reward, self.policy.adapter, self.prompts.prompts)
        self.start_iteration = 0
        self.resumed: CheckpointState | None = None
        if resume is not None:  # weights, version, optimizer and RNG states (refused if it does not fit)
            self.resumed = load_checkpoint(find_checkpoint(resume), self.policy)
            self.start_iteration = self.resumed.iteration

    def rollout(self, iteration: int) -> list[Samples]:
        cfg = self.cfg
        P, m = cfg.train.prompts_per_iteration, cfg.engine.unit_groups
        prompts = self.prompts.for_iteration(iteration, P)
        return [rollout_unit(self.policy, self.reward, prompts[j : j + m], list(range(j, j + m)), iteration,
                             cfg.train.seed) for j in range(0, P, m)]

    def iteration(self, iteration: int) -> dict:
        t0 = time.perf_counter()
        units = self.last_units = self.rollout(iteration)
        t_roll = time.perf_counter() - t0
        assign_advantages(units, self.cfg)
        total_terms = sum(len(u) * u.train_idx.shape[1] for u in units)
        stats = merge_stats([train_unit(self.policy, u, total_terms) for u in units])
        stats["grad_norm"] = self.policy.optimizer_step()
        wall = time.perf_counter() - t0
        return iteration_metrics(iteration, self.policy.version, units, stats, wall, rollout_s=t_roll)

    def maybe_save_samples(self, run_dir: Path, it: int, row: dict) -> None:
        every = self.cfg.output.save_samples_every
        last = it == self.cfg.train.iterations - 1
        if (every and it % every == 0) or last:
            save_iteration_samples(run_dir, it, self.last_units)

    def evaluate(self) -> dict:
        """``eval/<reward>`` means of the current weights over the whole prompt set (ODE, fixed seeds)."""
        from digenrl.evaluate import evaluate_policy

        if not hasattr(self, "_eval_prompts"):
            self._eval_prompts = load_prompts(self.cfg.prompts)
        return evaluate_policy(self.policy, self.reward, self._eval_prompts).metrics()

    def run(self, run_dir: Path | None = None, on_iteration: Callable[[dict], None] | None = None) -> RunResult:
        """Iterations ``start_iteration .. train.iterations-1``; a resumed run continues in the
        checkpoint's run directory (unless ``run_dir`` forks it elsewhere) and appends to its metrics."""
        cfg, out_cfg = self.cfg, self.cfg.output
        run_dir, history = resume_history(self.resumed, run_dir)
        if self.resumed is not None and self.start_iteration >= cfg.train.iterations:  # finished already
            return RunResult(Path(run_dir), history)
        out = RunDir(cfg, run_dir, history=history)
        rows = list(history or [])
        try:
            for it in range(self.start_iteration, cfg.train.iterations):
                row = self.iteration(it)
                done = it + 1  # iterations completed = the version a resume starts from
                if out_cfg.eval_every and done % out_cfg.eval_every == 0:
                    row.update(self.evaluate())
                rows.append(row)
                out.log(row)
                if on_iteration:
                    on_iteration(row)
                self.maybe_save_samples(out.path, it, row)
                if (out_cfg.checkpoint_every and done % out_cfg.checkpoint_every == 0) or done == cfg.train.iterations:
                    save_checkpoint(out.path, self.policy, done, cfg, keep_last=out_cfg.keep_last)
            if self.policy.lora:
                save_lora(self.policy.adapter, out.path / "final")
            else:
                from safetensors.torch import save_file

                (out.path / "final").mkdir(exist_ok=True)
                save_file(self.policy.weights(), out.path / "final" / "transformer.safetensors")
        finally:
            out.close()
        return RunResult(out.path, rows)


def resume_history(resumed: CheckpointState | None, run_dir: Path | None) -> tuple[Path | None, list[dict] | None]:
    """Where a (resumed) run writes and the metrics rows it keeps: a resumed run continues in its
    checkpoint's run directory unless ``run_dir`` forks it elsewhere, keeping the rows of the
    iterations the checkpoint holds (rows logged after it are dropped: they are run again)."""
    if resumed is None:
        return run_dir, None
    source = resumed.run_dir
    history = [r for r in _read_rows(source) if r.get("iteration", -1) < resumed.iteration] if source else []
    return run_dir or source or resumed.path, history


def _read_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl rows, skipping a line cut short by a crash."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def save_iteration_samples(run_dir: Path, iteration: int, units: list[Samples]) -> Path:
    """One sample per prompt group of the iteration, captioned with its prompt and reward."""
    from digenrl.media import save_samples

    G = len(units[0]) // len(units[0].group_ids)
    pixels = torch.cat([u.preview for u in units])
    captions = [f"{u.prompts[j * G]} {u.rewards[j * G]:.2f}" for u in units for j in range(len(u.group_ids))]
    return save_samples(pixels, captions, run_dir / "samples" / f"iter-{iteration:06d}")


def iteration_metrics(iteration: int, version: int, units: list[Samples], stats: dict, wall: float, **extra) -> dict:
    rewards = torch.cat([u.rewards for u in units])
    parts = {name: torch.cat([u.reward_parts[name] for u in units]) for name in units[0].reward_parts}
    n = len(rewards)
    row = {
        "iteration": iteration,
        "version": version,
        **reward_metrics(rewards, parts),  # reward_mean / reward_std / reward/<name>, NaN-safe
        "loss": stats.pop("loss"),
        "samples": n,
        "wall_s": wall,
        "samples_per_s": n / wall,
        "bubble_fraction": 0.0,
    }
    row.update(stats)
    row.update(extra)
    return row
