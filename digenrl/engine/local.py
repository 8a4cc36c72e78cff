"""The single-process driver (``placement.mode: local``): the algorithm, one iteration at a time.

Details: docs/modules.md, `digenrl.engine.local`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import torch

from digenrl.checkpoint.compat import CheckpointState
from digenrl.checkpoint.load import load_checkpoint
from digenrl.checkpoint.store import find_checkpoint, save_checkpoint
from digenrl.config.run import RunConfig
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.placement.layout import RunLayout, local_layout
from digenrl.policy.model import Policy, pick_device
from digenrl.rewards import build_reward
from digenrl.run.cadence import (
    RunCadence,
    RunResult,
    StopRequest,
    checkpoint_to_keep,
    final_files,
    iteration_metrics,
    resume_history,
    save_iteration_samples,
    stop_on_interrupt,
    stopped,
    write_final,
)
from digenrl.run.evaluate import evaluate_policy
from digenrl.run.rundir import RunDir
from digenrl.units.advantages import advantage_metrics, assign_advantages
from digenrl.units.rollout import preflight_reward, rollout_unit, scored
from digenrl.units.samples import Samples
from digenrl.units.train import merge_stats, train_unit


class LocalTrainer:
    """Everything in this process: one policy that both samples and trains."""

    def __init__(
        self,
        cfg: RunConfig,
        resume: Path | None = None,
        layout: RunLayout | None = None,
        resumed: CheckpointState | None = None,
    ):
        """``resume``: a run directory (its latest complete checkpoint) or a checkpoint directory (or
        ``resumed``, its state, when the caller has read it); ``layout``: the run's (default:
        :func:`~digenrl.placement.layout.local_layout`, one process)."""
        self.cfg = cfg
        self.layout = layout or local_layout(cfg)
        torch.manual_seed(cfg.train.seed)
        # build (and so validate) everything before anything is written
        self.prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed)
        self.reward = build_reward(cfg.reward)
        if pick_device(cfg.train.device).type == "cpu":  # as the engine's CPU workers: on shared cores
            torch.set_num_threads(1)  # more threads only spin (2 threads at load 5-9: 20x slower than 1)
        self.policy = Policy(cfg, layout=self.layout)
        preflight_reward(self.reward, self.policy.adapter, self.prompts.prompts)
        self.start_iteration = 0
        self.resumed: CheckpointState | None = None
        where = resumed.path if resumed is not None else resume and find_checkpoint(resume)
        if where is not None:  # weights, version, optimizer and RNG states (refused if it does not fit)
            self.resumed = load_checkpoint(where, self.policy)
            self.start_iteration = self.resumed.iteration

    def rollout(self, iteration: int) -> list[Samples]:
        cfg = self.cfg
        P, m = cfg.train.prompts_per_iteration, cfg.engine.unit_groups
        prompts = self.prompts.for_iteration(iteration, P)
        return [
            scored(
                rollout_unit(
                    self.policy, prompts[j : j + m], list(range(j, j + m)), iteration, cfg.train.seed
                ),
                self.reward,
            )
            for j in range(0, P, m)
        ]

    def iteration(self, iteration: int, stop: StopRequest | None = None) -> dict:
        """One iteration; a Ctrl-C (``stop``) during its rollout and gradients abandons it: until the
        optimizer step the weights and optimizer are those of the previous iteration."""
        t0 = time.perf_counter()
        steps = self.cfg.train.optimizer_steps  # mini-batch PPO; the last step publishes version k + 1
        with stop.abandonable() if stop is not None else contextlib.nullcontext():  # weights unchanged so far
            units = self.last_units = self.rollout(iteration)
            t_roll = time.perf_counter() - t0
            assign_advantages(units, self.cfg)
            terms = (
                sum(len(u) * u.train_idx.shape[1] for u in units) // steps
            )  # a mini-batch's loss is its mean
            parts = [train_unit(self.policy, u, terms, minibatch=0, minibatches=steps) for u in units]
        norms = [self.policy.optimizer_step(publish=steps == 1)]
        for s in range(1, steps):  # mini-batch s: the s-th slice of every group's samples
            parts += [train_unit(self.policy, u, terms, minibatch=s, minibatches=steps) for u in units]
            norms.append(self.policy.optimizer_step(publish=s == steps - 1))
        stats = merge_stats(parts, steps)
        stats["grad_norm"] = sum(norms) / steps
        wall = time.perf_counter() - t0
        row = iteration_metrics(iteration, self.policy.version, units, stats, wall, rollout_s=t_roll)
        return {**row, **advantage_metrics(units, self.cfg)}

    def evaluate(self) -> dict:
        """``eval/<reward>`` means of the current (with ``train.ema``: the EMA) weights over the whole
        prompt set (ODE, fixed seeds)."""

        if not hasattr(self, "_eval_prompts"):
            self._eval_prompts = load_prompts(self.cfg.prompts)
        with self.policy.averaged():  # train.ema: the EMA weights
            return evaluate_policy(self.policy, self.reward, self._eval_prompts).metrics()

    def run(
        self, run_dir: Path | None = None, on_iteration: Callable[[dict], None] | None = None
    ) -> RunResult:
        """Iterations ``start_iteration .. train.iterations-1``; a resumed run continues in the
        checkpoint's run directory (unless ``run_dir`` forks it elsewhere) and appends to its metrics."""
        cfg, cadence = self.cfg, RunCadence(self.cfg)
        run_dir, history = resume_history(self.resumed, run_dir)
        if self.resumed is not None and self.start_iteration >= cfg.train.iterations:  # finished already
            return RunResult(Path(run_dir), history)
        out = RunDir(cfg, run_dir, history=history)
        self.layout.write(out.path)
        rows = list(history or [])
        try:
            with stop_on_interrupt() as stop:
                try:
                    self._iterations(out, rows, cadence, stop, on_iteration)
                except BaseException as exc:
                    raise self._keep_work(exc, out.path, rows, stop) from None
            write_final(out.path, final_files(self.policy))
        finally:
            out.close()
        return RunResult(out.path, rows)

    def _iterations(
        self, out: RunDir, rows: list[dict], cadence: RunCadence, stop: StopRequest, on_iteration
    ) -> None:
        cfg = self.cfg
        for it in range(self.start_iteration, cfg.train.iterations):
            if stop.requested:  # Ctrl-C during the last iteration's logging: stop before the next
                raise KeyboardInterrupt
            row = self.iteration(it, stop)
            if cadence.eval_due(it):
                row.update(self.evaluate())
            out.log(row)
            rows.append(row)
            if on_iteration:
                on_iteration(row)
            if cadence.samples_due(it):
                out.log_image(save_iteration_samples(out.path, it, self.last_units), it)
            if cadence.checkpoint_due(it):
                save_checkpoint(out.path, self.policy, it + 1, cfg, keep_last=cfg.output.keep_last)

    def _keep_work(
        self, exc: BaseException, run_dir: Path, rows: list[dict], stop: StopRequest
    ) -> BaseException:
        """Stopped mid-run (Ctrl-C, or an error such as a reward failure): checkpoint the last completed
        iteration when the policy still holds exactly it (not after a second Ctrl-C: that means now)."""
        done = rows[-1]["iteration"] + 1 if rows else self.start_iteration
        if isinstance(exc, (KeyboardInterrupt, Exception)) and not stop.forced:
            if checkpoint_to_keep(run_dir, done, self.policy.version):
                save_checkpoint(run_dir, self.policy, done, self.cfg, keep_last=self.cfg.output.keep_last)
        return stopped(exc, run_dir, done, self.cfg.train.iterations)
