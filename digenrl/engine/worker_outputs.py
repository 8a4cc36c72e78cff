"""What an engine worker hands back besides units: its weights, a published packet, its checkpoint
files, an evaluation, ``final/``'s files (each a group call: a sharded group's ranks all join)."""

from __future__ import annotations

from pathlib import Path

import torch

from digenrl.checkpoint.store import checkpoint_files
from digenrl.engine import weight_sync
from digenrl.engine.fsdp_group import reshard
from digenrl.engine.groups import group_call
from digenrl.rewards import build_reward, scored_after_unit
from digenrl.rewards.base import score
from digenrl.run.cadence import final_files
from digenrl.run.evaluate import eval_metrics, eval_samples


class OutputsMember:
    """The output calls of an :class:`~digenrl.engine.workers.EngineWorker` (its attributes)."""

    cfg: object  # the RunConfig
    name: str
    policy: object  # digenrl.policy.model.Policy
    prompts: object  # digenrl.data.prompts.PromptSampler
    reward: object  # this worker's reward (None: it scores nothing)
    eval_reward: object  # a trainer rank's reward for eval only, built on its first eval
    rank: int
    sharded: bool

    # -- results -------------------------------------------------------------------------

    @group_call()
    def weights(self) -> dict[str, torch.Tensor]:
        return self.policy.weights()

    @group_call()
    def publish(self) -> weight_sync.WeightPacket:
        """The weights this worker holds as a packet (the driver keeps the starting version's, for
        a re-queued unit of that version on a rollout worker that has moved on)."""
        if self.rank > 0:  # a sharded rank > 0: its part of the gather
            self.policy.weights()
            return None
        return weight_sync.publish(self.policy)[0]

    @group_call()
    def checkpoint(self, iteration: int, extra: dict, staging: str | None = None) -> dict:
        """This rank's checkpoint after ``iteration`` iterations, as file bytes for the driver.
        The driver calls it right after the step, before handing this rank more work (an actor runs
        its calls in order), so it holds exactly version ``iteration`` and no partial gradient.
        A sharded group: every rank writes its shards of the optimizer state by path into ``staging``
        (DCP, nothing gathered) and joins the gather of the weights; rank 0's answer names ``staging``."""
        if self.policy.version != iteration:
            raise RuntimeError(
                f"{self.name}: checkpoint of iteration {iteration} asked at version {self.policy.version}"
            )
        files = checkpoint_files(
            self.policy,
            iteration,
            self.cfg,
            extra,
            optimizer_dir=Path(staging) if self.sharded and staging else None,
            lead=self.rank == 0,
            where=f"{self.name}'s node",
        )
        return files

    @group_call()  # a sharded group: every rank runs the same sampling passes
    def evaluate(self) -> dict:
        """``eval/<reward>`` of the current weights (ODE, fixed seeds), as LocalTrainer.evaluate. In a run
        that scores on its rollout workers (a model reward, :func:`~digenrl.rewards.scored_after_unit`)
        a trainer rank holds no reward: it returns ``{"eval_decoded": Decoded}`` and the driver has a
        rollout worker score them (:meth:`score`), as it does a TAG rank's units."""

        with self.policy.averaged():  # train.ema: the EMA weights
            decoded = eval_samples(self.policy, self.prompts.prompts)
            if self.sharded:  # sampling leaves the root's parameters gathered (no backward frees them):
                reshard(self.policy.adapter.transformer)  # drop that copy before the weights swap back
        if self.reward is None and scored_after_unit(self.cfg):  # no reward here: a rollout worker's
            return {"eval_decoded": decoded}
        if self.reward is None:  # a trainer rank that never scores (a function reward): built for eval only
            self.eval_reward = self.eval_reward or build_reward(self.cfg.reward)
        scores = score(self.reward or self.eval_reward, decoded)
        return eval_metrics(scores.total, scores.parts)

    @group_call()
    def export_final(self) -> dict[str, bytes]:
        """``final/``'s files (:func:`~digenrl.run.cadence.final_files`), as bytes for the driver, which
        writes them wherever its run directory is (possibly another node)."""
        return final_files(self.policy)  # gathers shards on every rank
