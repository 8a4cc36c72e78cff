"""The iteration ledger: what the engine's driver keeps of each iteration until its metrics row is out.

Details: docs/modules.md, `digenrl.engine.ledger`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from digenrl.checkpoint.store import save_checkpoint_files
from digenrl.config.run import RunConfig
from digenrl.engine.timeline import Timeline
from digenrl.rewards.service import reward_call_metrics
from digenrl.run.cadence import RunCadence, iteration_metrics, save_iteration_samples
from digenrl.schedule.scheduler import SchedulerConfig
from digenrl.units.advantages import advantage_metrics, assign_advantages
from digenrl.units.train import merge_stats
from digenrl.units.types import RolloutUnit, TrainUnit


@dataclass
class RewardBatch:
    """What the driver keeps of a rollout unit: rewards (advantages, metrics) and the preview
    pixels (sample grids), not its samples. Quacks like ``Samples`` for those uses."""

    rewards: torch.Tensor
    reward_parts: dict[str, torch.Tensor]
    prompts: list[str]
    group_ids: list[int]
    preview: torch.Tensor | None = None
    advantages: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rewards)

    @classmethod
    def join(cls, parts: list[RewardBatch]) -> RewardBatch:
        """One group from its parts, in part order (the preview is part 0's: the group's first sample)."""
        keys = parts[0].reward_parts
        return cls(
            torch.cat([p.rewards for p in parts]),
            {k: torch.cat([p.reward_parts[k] for p in parts]) for k in keys},
            [t for p in parts for t in p.prompts],
            list(parts[0].group_ids),
            parts[0].preview,
        )


class IterationLedger:
    def __init__(
        self,
        cfg: RunConfig,
        sched_cfg: SchedulerConfig,
        timeline: Timeline,
        out,
        on_iteration: Callable[[dict], None] | None = None,
        history: list[dict] | None = None,
        restarts: Callable[[], int] = lambda: 0,
    ):
        """``out``: the :class:`~digenrl.run.rundir.RunDir` rows go to; ``restarts``: the run's worker
        restarts so far (a metrics column)."""
        self.cfg, self.units_per_iteration = cfg, sched_cfg.units_per_iteration
        self.timeline, self.out, self.on_iteration, self.restarts = timeline, out, on_iteration, restarts
        self.cadence = RunCadence(cfg)
        self.rows: list[dict] = list(history or [])
        self.batches: dict[str, RewardBatch] = {}  # rollout uid -> rewards / advantages
        # iteration -> key -> a batch of whole groups: the unit's own (key: unit index), or a group
        # joined from its parts (key: group id; ``members`` its parts' batches)
        self.whole: dict[int, dict[int, RewardBatch]] = defaultdict(dict)
        self.members: dict[int, list[RewardBatch]] = {}  # id(joined batch) -> its parts, in order
        self.parts_in: dict[
            tuple[int, int], dict[int, RewardBatch]
        ] = {}  # (iteration, group) -> part -> batch
        self.wholes_per_iteration = sched_cfg.groups_per_iteration // sched_cfg.unit_groups
        self.unit_uids: dict[int, dict[int, str]] = defaultdict(dict)  # iteration -> index -> rollout uid
        self.total_terms: dict[int, int] = {}  # iteration -> (sample, trained step) terms
        self.optimizer_steps = cfg.train.optimizer_steps  # mini-batches per iteration, of equal size
        self.reward_calls: dict[int, list[dict]] = defaultdict(list)  # iteration -> reward calls (latency)
        self.stats: dict[int, list[dict]] = defaultdict(list)
        self.staleness: dict[int, int] = defaultdict(int)
        self.grad_norm: dict[int, list[float]] = defaultdict(list)  # iteration -> one per optimizer step
        self.evals: dict[int, dict] = {}  # iteration -> eval/<reward> metrics
        self.checkpoints: dict[int, dict[str, bytes]] = {}  # iteration -> files, committed after its row
        self.waiting: dict[int, set[str]] = {}  # stepped iteration -> what its row still waits for

    # -- what units leave behind -------------------------------------------------------------

    def rolled_out(self, unit: RolloutUnit, summary: dict) -> None:
        """A rollout unit is scored: keep its rewards; its group's advantages as soon as they can be known."""
        k, per_iteration = unit.iteration, self.units_per_iteration
        self.reward_calls[k] += summary.get("reward_calls", [])
        batch = self.batches[unit.uid] = RewardBatch(
            summary["rewards"],
            summary["reward_parts"],
            summary["prompts"],
            summary["group_ids"],
            summary["preview"],
        )
        self.unit_uids[k][unit.index] = unit.uid
        terms = summary["terms"] * per_iteration  # every unit of an iteration has the same size
        if self.total_terms.setdefault(k, terms) != terms:
            raise RuntimeError(f"{unit.uid}: units of iteration {k} differ in size")
        whole = self._whole_groups(unit, batch)
        if whole is None:  # a part of a group whose other parts are not all scored yet
            return
        if self.cfg.algorithm.std == "global":
            if len(self.whole[k]) == self.wholes_per_iteration:  # the scheduler holds training back until now
                self._assign(self.iteration_batches(k))
        else:
            self._assign([whole])

    def _whole_groups(self, unit: RolloutUnit, batch: RewardBatch) -> RewardBatch | None:
        """The batch of whole groups ``unit`` completes: its own, or (a part) its group joined from all
        its parts once the last one is in; None while parts are missing."""
        k = unit.iteration
        if unit.parts == 1:
            self.whole[k][unit.index] = batch
            return batch
        (g,) = unit.groups
        parts = self.parts_in.setdefault((k, g), {})
        if unit.part in parts or g in self.whole[k]:
            raise RuntimeError(f"{unit.uid}: part {unit.part} of group {g} scored twice")
        parts[unit.part] = batch
        if len(parts) < unit.parts:
            return None
        del self.parts_in[(k, g)]
        joined = self.whole[k][g] = RewardBatch.join([parts[p] for p in range(unit.parts)])
        self.members[id(joined)] = [parts[p] for p in range(unit.parts)]
        return joined

    def _assign(self, wholes: list[RewardBatch]) -> None:
        """Advantages over whole groups; a joined group's are split back to its parts."""
        for b in wholes:
            if len(b) % self.cfg.algorithm.group_size:
                raise RuntimeError(
                    f"advantages asked over a partial group ({len(b)} samples, group "
                    f"{b.group_ids}, G = {self.cfg.algorithm.group_size})"
                )
        assign_advantages(wholes, self.cfg)
        for b in wholes:
            members = self.members.pop(id(b), None)
            if members:
                for part, adv in zip(members, b.advantages.split([len(m) for m in members])):
                    part.advantages = adv

    def advantages(self, unit: TrainUnit) -> torch.Tensor:
        adv = self.batches[unit.rollout_uid].advantages
        if adv is None:
            raise RuntimeError(f"{unit.uid}: advantages asked before every part of its groups is scored")
        return adv

    def trained(self, unit: TrainUnit, stats: dict) -> None:
        k = unit.iteration
        self.stats[k].append(stats)
        self.staleness[k] = max(self.staleness[k], k - unit.sample_version)

    def minibatch_terms(self, k: int) -> int:
        """(sample, trained step) terms of one mini-batch of iteration k: its loss is their mean."""
        return self.total_terms[k] // self.optimizer_steps

    def stepped(self, k: int, grad_norm: float) -> None:
        """Trainer rank 0's share of one of iteration k's optimizer steps."""
        self.grad_norm[k].append(grad_norm)

    def iteration_batches(self, k: int) -> list[RewardBatch]:
        """The iteration's rolled-out batches of whole groups in group order (as the LocalTrainer sees
        them)."""
        mine = self.whole[k]
        return [mine[j] for j in sorted(mine)]

    # -- metrics rows, eval and checkpoints, in order ----------------------------------------

    def wait_for(self, k: int, names: set[str]) -> None:
        """Iteration k's step is done: its row waits for ``names`` (units still running in its
        span, the eval / checkpoint asked for)."""
        self.waiting[k] = set(names)
        self.flush()

    def finished(self, name: str) -> None:
        """A unit (its uid) or a side call (``eval-k`` / ``checkpoint-k``) finished."""
        for running in self.waiting.values():
            running.discard(name)
        self.flush()

    def evaluated(self, k: int, metrics: dict) -> None:
        self.evals[k] = metrics
        self.finished(f"eval-{k}")

    def checkpointed(self, k: int, files: dict[str, bytes]) -> None:
        self.checkpoints[k] = files
        self.finished(f"checkpoint-{k}")

    def flush(self) -> None:
        """Write every row no longer waiting, oldest first, each followed by its checkpoint."""
        while self.waiting and not self.waiting[min(self.waiting)]:
            k = min(self.waiting)
            del self.waiting[k]
            row = self.metrics_row(k)
            self.rows.append(row)
            self.out.log(row)
            if self.on_iteration:
                self.on_iteration(row)
            if k in self.checkpoints:
                save_checkpoint_files(
                    self.out.path, k + 1, self.checkpoints.pop(k), self.cfg.output.keep_last
                )

    def metrics_row(self, k: int) -> dict:
        (span,) = self.timeline.iteration_stats(only=k)
        stats = merge_stats(self.stats.pop(k), self.optimizer_steps)
        norms = self.grad_norm.pop(k)
        stats["grad_norm"] = sum(norms) / len(norms)
        batches = self.iteration_batches(k)
        row = iteration_metrics(
            k,
            k + 1,
            batches,
            stats,
            span["wall_s"],
            samples_per_s=span["samples_per_s"],
            bubble_fraction=span["bubble_fraction"],
            rollout_s=span["rollout_device_s"],
            train_s=span["train_device_s"],
            sync_s=span["sync_s"],
            sync_bytes=span["sync_bytes"],
            sample_staleness=self.staleness.pop(k, 0),
        )
        row.update(advantage_metrics(batches, self.cfg))
        row.update(reward_call_metrics(self.reward_calls.pop(k, [])))
        row.update(self.evals.pop(k, {}))
        row["worker_restarts"] = self.restarts()
        if self.cadence.samples_due(k):
            self.out.log_image(save_iteration_samples(self.out.path, k, batches), k)
        for uid in self.unit_uids.pop(k).values():
            del self.batches[uid]
        del self.whole[k]
        return row
