"""The single-process driver (``placement.mode: local``): the algorithm, one iteration at a time.

    for each iteration:
        sample prompts -> rollout units (generate, decode, score) -> group advantages
        -> train units (accumulate gradients) -> one optimizer step -> log
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from digenrl.config import RunConfig
from digenrl.lora import save_lora
from digenrl.policy import Policy
from digenrl.prompts import PromptSampler, load_prompts
from digenrl.rewards import build_reward
from digenrl.runlog import RunDir
from digenrl.units import Samples, assign_advantages, merge_stats, rollout_unit, train_unit


@dataclass
class RunResult:
    run_dir: Path
    metrics: list[dict]


class LocalTrainer:
    """Everything in this process: one policy that both samples and trains."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        # build (and so validate) everything before anything is written
        self.prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed)
        self.reward = build_reward(cfg.reward)
        self.policy = Policy(cfg)

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

    def run(self, run_dir: Path | None = None, on_iteration: Callable[[dict], None] | None = None) -> RunResult:
        out = RunDir(self.cfg, run_dir)
        rows = []
        try:
            for it in range(self.cfg.train.iterations):
                row = self.iteration(it)
                rows.append(row)
                out.log(row)
                if on_iteration:
                    on_iteration(row)
                self.maybe_save_samples(out.path, it, row)
            if self.policy.lora:
                save_lora(self.policy.adapter, out.path / "final")
            else:
                from safetensors.torch import save_file

                (out.path / "final").mkdir(exist_ok=True)
                save_file(self.policy.weights(), out.path / "final" / "transformer.safetensors")
        finally:
            out.close()
        return RunResult(out.path, rows)


def save_iteration_samples(run_dir: Path, iteration: int, units: list[Samples]) -> Path:
    """One sample per prompt group of the iteration, captioned with its prompt and reward."""
    from digenrl.media import save_samples

    G = len(units[0]) // len(units[0].group_ids)
    pixels = torch.cat([u.preview for u in units])
    captions = [f"{u.prompts[j * G]} {u.rewards[j * G]:.2f}" for u in units for j in range(len(u.group_ids))]
    return save_samples(pixels, captions, run_dir / "samples" / f"iter-{iteration:06d}")


def iteration_metrics(iteration: int, version: int, units: list[Samples], stats: dict, wall: float, **extra) -> dict:
    rewards = torch.cat([u.rewards for u in units])
    n = len(rewards)
    row = {
        "iteration": iteration,
        "version": version,
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "loss": stats.pop("loss"),
        "samples": n,
        "wall_s": wall,
        "samples_per_s": n / wall,
        "bubble_fraction": 0.0,
    }
    for name in units[0].reward_parts:
        row[f"reward/{name}"] = torch.cat([u.reward_parts[name] for u in units]).mean().item()
    row.update(stats)
    row.update(extra)
    return row
