"""The Ray actor that executes units: one per device (or per multi-device group's lead), in the role
the placement gives it -- ``rollout``, ``trainer`` or ``both`` (colocated). Every worker builds the
same things from the RunConfig in the same order as the local trainer, so the same seed gives the
same initial weights everywhere. What each role holds and how a unit is scored: docs/architecture.md,
"The Ray runtime, split by concern"."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from digenrl.checkpoint.load import load_checkpoint
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.distributed.checkpointing import is_checkpointed
from digenrl.distributed.fsdp import all_reduce_replicas
from digenrl.engine import sync_group, weight_sync
from digenrl.engine.faults import FaultInjector
from digenrl.engine.fsdp_group import combine_rank_stats, train_share
from digenrl.engine.groups import GroupMember, group_call
from digenrl.engine.sp_group import SequenceParallelMember
from digenrl.engine.worker_outputs import OutputsMember
from digenrl.engine.worker_setup import ResumeFrom, gc_paused_then_frozen, generates, restarted
from digenrl.errors import UserError
from digenrl.placement.layout import RunLayout
from digenrl.policy.model import Policy, compile_transformer, pick_device
from digenrl.rewards import build_reward, scored_after_unit
from digenrl.rewards.base import Decoded, Scores, score
from digenrl.rewards.service import reward_client
from digenrl.units.rollout import preflight_reward, rollout_unit
from digenrl.units.samples import Samples
from digenrl.units.train import train_unit
from digenrl.units.types import RolloutUnit, StepUnit, TrainUnit


def unit_event(kind: str, unit, start: float, end: float, version: int, sample_versions=(), **args) -> dict:
    return {
        "kind": kind,
        "uid": unit.uid,
        "iteration": unit.iteration,
        "version": version,
        "start": start,
        "end": end,
        "sample_versions": tuple(sample_versions),
        "args": args,
    }


#: the actor's concurrency group of :meth:`EngineWorker.score` (its other calls run one at a time, in order)
SCORE_GROUP = "score"


class EngineWorker(GroupMember, SequenceParallelMember, OutputsMember):
    """Plain class; the runtime wraps it with ``ray.remote`` and the pool's resources."""

    #: freeze what the build made (:func:`gc_paused_then_frozen`); a process built again turns it off
    freeze_build = True

    def __init__(
        self,
        cfg,
        name: str,
        role: str,
        reward_actor=None,
        resume: ResumeFrom | None = None,
        sp_follower: bool = False,
        layout: RunLayout | None = None,
    ):
        """``resume``: the checkpoint to start from (read by path); ``sp_follower``: a rollout worker
        that follows its sequence-parallel group's lead (it scores nothing); ``layout``: the run's
        (:mod:`digenrl.placement.layout`), which this worker reads and never re-derives (None: a worker built
        outside a run, with a single process's settings)."""
        self.cfg, self.name, self.role, self.layout = cfg, name, role, layout
        self.sp_follower = sp_follower
        self.resume_optimizer: str | None = None  # a sharded rank loads it once sharded (join_group)
        self.faults = FaultInjector.from_config(cfg, name)  # engine.faults: where this process dies
        # A config error raised here would reach the driver as an opaque ActorDiedError: keep it
        # and raise it from ready(), where Ray hands the driver the exception itself.
        self.init_error = None
        try:
            with gc_paused_then_frozen(freeze=self.freeze_build):
                self._build(cfg, reward_actor)
            if resume is not None:
                self._resume(resume)
        except UserError as exc:
            self.init_error = exc

    def _resume(self, source: ResumeFrom) -> None:
        """Weights, version, RNG states (and, on trainer ranks, optimizer state) of the checkpoint,
        read from its directory; a rollout worker never opens ``optimizer.pt``. A rollout worker
        that cannot see the directory (another node, or restarted after the checkpoint was rotated
        away) reads the files it needs from the driver's copy in the object store."""
        path = Path(source.path)
        trains = self.policy.optimizer is not None
        if path.is_dir():
            # a rank that will shard rebuilds its optimizer over the shards: its state loads then
            shards = trains and self.layout is not None and self.layout.will_shard(self.role)
            load_checkpoint(path, self.policy, optimizer=trains and not shards)
            self.resume_optimizer = str(path) if shards else None
            return
        if trains:
            raise UserError(
                f"--resume: {path} is not visible on {self.name}'s node: trainer ranks read the "
                "checkpoint directory by path (put the run directory where every node mounts it)"
            )
        import ray

        with tempfile.TemporaryDirectory() as tmp:
            for fname, data in ray.get(source.rollout_files).items():
                (Path(tmp) / fname).write_bytes(data)
            load_checkpoint(Path(tmp), self.policy, optimizer=False)

    def _build(self, cfg, reward_actor) -> None:
        # the device the layout gives this worker (train.device resolved for its pool, never here)
        self.device = pick_device(
            self.layout.worker(self.name).torch_device if self.layout else cfg.train.device
        )
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # one thread per CPU worker: they share few cores with each other
        torch.manual_seed(cfg.train.seed)  # same construction order as LocalTrainer
        self.prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed)
        # this worker rolls out, so it scores (a sequence-parallel follower: its lead scores)
        scores = (self.role != "trainer" or cfg.engine.tag) and not self.sp_follower
        self.pending: dict[str, Decoded] = {}  # units scored after them: uid -> their decoded samples
        self.eval_reward = None  # a trainer rank that evaluates builds the rewards then
        self.scoring, self.reward = None, None  # how this worker's units are scored (:meth:`scores_of`)
        if scores and reward_actor is not None:  # reward.service: the models live in the shared actor only
            self.scoring, self.reward = "service", reward_client(cfg.reward, reward_actor)
        elif scores and scored_after_unit(cfg):  # a model reward: on rollout workers only, after the unit
            self.scoring = "after"
            self.reward = build_reward(cfg.reward) if self.role == "rollout" else None
        elif scores:
            self.scoring, self.reward = "inline", build_reward(cfg.reward)
        lean = not generates(cfg, self.role)  # a lean trainer rank: no text encoder, no VAE
        self.policy = Policy(  # a checkpoint: transformer alone
            cfg, self.device, trainable=self.role != "rollout", generates=not lean, layout=self.layout
        )
        if lean:  # a preset builds them all: release them
            self.policy.adapter.release_generation_modules()
        if cfg.engine.compile_rollout == "on" and self.role == "rollout":
            compile_transformer(self.policy, cfg.engine.compile_mode)
        self.expected_keys = self.policy.weight_names()
        if self.reward is not None and not restarted():  # dry-run the rewards on this worker's decoded
            # shape (once: a restarted worker was checked at the start, the reward actor may be restarting)
            preflight_reward(self.reward, self.policy.adapter, self.prompts.prompts)

    @group_call()
    def ready(self) -> dict:
        if self.init_error is not None:
            raise self.init_error
        return {  # (on a sharded group, gathers every rank joins)
            "checksum": self.policy.weights_checksum(),
            "device": str(self.policy.device),
            "pid": os.getpid(),
            "version": self.policy.version,
            "node": _node_id(),
        }

    def resolved(self) -> dict:
        """What this worker runs with, read off what it built and joined (not off the config): the
        tests compare it with the layout's :class:`~digenrl.placement.layout.WorkerLayout` and settings."""

        sampling = self.policy.adapter.sampling
        return {
            "rank": self.rank if self.role != "rollout" else None,
            "fsdp": self.degree,
            "sp": self.sp_world,
            "followers": len(self.followers),
            "activation_checkpointing": is_checkpointed(self.policy.adapter.transformer),
            "cfg_batching": sampling.cfg_batching,
            "vae_tiling": sampling.vae_tiling,
            "weight_sync": type(self.sync).__name__ if self.sync is not None else None,
            "compiled": getattr(self.policy.adapter.transformer, "_compiled_call_impl", None) is not None,
        }

    # -- units ---------------------------------------------------------------------------

    # engine.rollout_sp: the group generates together; a trainer group (FSDP, TAG / colocated): each
    # follower its share (GroupMember.group_rollout)
    @group_call(lambda lead: "rollout_share" if lead.role != "rollout" else "sp_rollout")
    def rollout(self, unit: RolloutUnit, packet: weight_sync.WeightPacket | None) -> tuple[Samples, dict]:
        """Generate, decode and score the unit's groups with exactly version ``unit.version`` (a
        re-queued unit may be older than what this worker holds: the packet has its weights).

        With ``reward.service`` the scoring is only submitted: the summary's ``reward_ref``
        (an ObjectRef of a :class:`~digenrl.rewards.service.Scored`) replaces its rewards, and
        the samples carry NaN placeholders."""
        events, missed = [], None
        if unit.version != self.policy.version:
            if self.role != "rollout":
                raise RuntimeError(
                    f"{self.name} holds version {self.policy.version}, unit {unit.uid} needs {unit.version}"
                )
            try:
                events.append(
                    weight_sync.load_version(
                        self.policy, unit.version, unit.iteration, packet, self.sync, self.expected_keys
                    )
                )
            except sync_group.VersionMissed as exc:
                missed = str(exc)
        if self.role == "rollout" and self.sp_world > 1 and self.any_member_missed(missed is not None):
            missed = (
                missed or f"a member of {self.name}'s sequence-parallel group missed version {unit.version}"
            )
        if missed is not None:  # the driver sends the unit again, with the version
            return None, {"missed": unit.version, "why": missed}
        cfg = self.cfg
        group = self.role != "rollout" and self.followers  # a trainer group generates each unit together
        everything = self.prompts.for_iteration(unit.iteration, cfg.train.prompts_per_iteration)
        start = time.time()
        batch = self.policy.settings.sampling_batch(self.role)  # engine.rollout_batch / colocated_batch
        if group:  # every rank its share (fsdp_group.unit_share), merged here
            samples, decoded = self.group_rollout(unit)
        else:
            samples, decoded = rollout_unit(
                self.policy,
                [everything[g] for g in unit.groups],
                list(unit.groups),
                unit.iteration,
                cfg.train.seed,
                unit.sample_range(cfg.algorithm.group_size),
                batch,
            )
        scoring = self.scores_of(unit, decoded)  # inline: scored now, inside the unit
        end = time.time()
        self.followers_done()
        self.faults.reached(unit.uid)
        if samples.version != unit.version or self.policy.version != unit.version:
            raise RuntimeError(f"{unit.uid}: weights changed inside the unit")
        events.append(
            unit_event(
                "rollout",
                unit,
                start,
                end,
                unit.version,
                samples=len(samples),
                groups=list(unit.groups),
                sp=self.sp_world,
                batch=batch,  # samples per sampling forward (None: the train forwards' batches)
                ref_forwards=samples.timings.get("ref_forwards", 0),  # algorithm.kl_reference rollout
            )
        )
        if isinstance(self.sync, sync_group.BroadcastInbox):  # versions received meanwhile
            events += self.sync.drain_events()
        summary = {
            "terms": len(samples) * samples.train_idx.shape[1],  # (sample, trained step) terms
            "prompts": samples.prompts,
            "group_ids": samples.group_ids,
            "preview": samples.preview,  # first sample of each group, uint8: for the sample grids
            "version": samples.version,
            "events": events,
            **scoring,
        }
        return samples, summary

    def scores_of(self, unit: RolloutUnit, decoded: Decoded) -> dict:
        """How a rolled-out unit's scores reach the driver, by this worker's scoring mode: ``scores``
        (inline: :func:`~digenrl.rewards.base.score` here, now); ``reward_ref`` (``reward.service``: its
        ObjectRef, this worker moves on); ``score_on`` (a model reward scored after the unit, beside
        the next one: :meth:`score`); ``decoded`` (a TAG rank's: the driver has a rollout worker score it)."""
        if self.scoring == "service":
            return {"reward_ref": self.reward.submit_scored(decoded, unit.uid)}
        if self.scoring == "after" and self.reward is None:
            return {"decoded": decoded}
        if self.scoring == "after":
            self.pending[unit.uid] = decoded
            return {"score_on": self.name}
        return {"scores": score(self.reward, decoded)}

    def score(self, uid: str, decoded: Decoded | None = None) -> Scores:
        """Score a rollout unit after it (a model reward): its decoded samples kept by :meth:`rollout`
        here, or ``decoded`` (a TAG trainer rank's, or its eval samples). Runs in the actor's ``score``
        concurrency group, beside the worker's next unit on the same device."""
        scores = score(self.reward, decoded if decoded is not None else self.pending.pop(uid))
        scores.queue_depth = len(self.pending)
        return scores

    def holds_reward(self) -> bool:
        """Whether this worker built the reward models (the tests: trainer ranks never do)."""
        return (self.reward is not None and self.scoring != "service") or self.eval_reward is not None

    @group_call()
    def train(self, unit: TrainUnit, samples: Samples, advantages: torch.Tensor, total_terms: int) -> dict:
        """Accumulate this unit's share of its mini-batch's gradient (no optimizer step);
        ``total_terms``: the mini-batch's (sample, trained step) terms."""
        if self.policy.version != unit.version:
            raise RuntimeError(
                f"{self.name} holds version {self.policy.version}, {unit.uid} needs {unit.version}"
            )
        if (samples.iteration, tuple(samples.group_ids), samples.version) != (
            unit.iteration,
            unit.groups,
            unit.sample_version,
        ):
            raise RuntimeError(f"{unit.uid}: received samples of another unit")
        samples.advantages = advantages
        self.faults.reached(f"{unit.uid}:start")  # engine.faults: dies while its group waits in the unit
        start = time.time()
        sp = self.sp_world  # engine.trainer_sp: each sequence-parallel group of sp ranks trains one share
        if self.sharded:  # every rank (group) trains an equal share of the unit's (mini-batch's) samples
            stats = train_share(
                self.policy, samples, unit, (self.rank % self.degree) // sp, self.degree // sp, total_terms
            )
        else:
            stats = train_unit(
                self.policy,
                samples,
                total_terms,
                unit.tsp_rank,
                unit.tsp_degree,
                unit.step,
                self.cfg.train.optimizer_steps,
            )
        shares = [r["stats"] for r in self.followers_done()]  # (the group's other ranks in order)
        stats = combine_rank_stats(
            ([stats] + shares)[::sp]
        )  # one per share: SP followers repeat their lead's
        self.faults.reached(unit.uid)
        end = time.time()
        event = unit_event(
            "train",
            unit,
            start,
            end,
            self.policy.version,
            sample_versions=[samples.version],
            groups=list(samples.group_ids),
            tsp_rank=unit.tsp_rank,
            tsp_degree=unit.tsp_degree,
            minibatch=unit.step,
            sp=self.sp_world,
            ref_forwards=stats.get("ref_forwards", 0),  # KL reference forwards (0: shipped with the samples)
        )
        return {"stats": stats, "events": [event]}

    @group_call()
    def step(self, unit: StepUnit, publish: bool | str) -> dict:
        """All-reduce, one optimizer step (the iteration's last -> version k+1), and on rank 0 after
        the last step the weight publish (``publish``: its transport, broadcast or object_store)."""
        start = time.time()
        if not self.sharded:  # FSDP2 reduce-scattered the gradients in backward (inside each shard group)
            self._all_reduce_gradients()
        else:  # HSDP: sum the gradient shards over the replica groups (nothing with one group)
            all_reduce_replicas(self.policy.params, self.mesh)
        grad_norm = self.policy.optimizer_step(publish=unit.last)
        if self.policy.version != unit.version:
            raise RuntimeError(
                f"{self.name}: stepped to version {self.policy.version}, expected {unit.version}"
            )
        events, packet, failed = [], None, False
        if publish and self.rank > 0:  # a sharded rank > 0: its part of the gather, nothing shipped
            sync_group.take_part(self.policy, publish)
        elif publish:
            packet, events, failed = weight_sync.publish_version(
                self.policy, self.sync, "object_store" if publish is True else publish, self.faults, self.name
            )
        digest = self.policy.agreement_digest() if self.policy.lora else None  # ranks must agree
        self.followers_done()
        publishes = {"publishes": unit.version} if unit.last else {}
        events.insert(
            0, unit_event("step", unit, start, time.time(), unit.iteration, step=unit.step, **publishes)
        )
        return {
            "grad_norm": grad_norm,
            "packet": packet,
            "checksum": digest,
            "events": events,
            "sync_failed": failed,
        }


def _node_id() -> str | None:
    """The Ray node this actor runs on (None outside Ray): the driver names it when the node leaves."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
