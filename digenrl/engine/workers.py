"""The Ray actor that executes units: one per device, in the role the placement gives it.

Every worker process builds the same things from the RunConfig in the same order as the
single-process :class:`~digenrl.engine.local.LocalTrainer` (seed, prompts, reward, policy), so the
same seed gives identical initial weights everywhere; the runtime checks the checksums. Only
workers that score build the reward models (never with ``reward.service``, never a trainer
rank without TAG); building them draws no random numbers, so skipping it changes nothing.

- role ``rollout``: runs :func:`~digenrl.units.rollout.rollout_unit` (generation, decode, reward: the
  reward stays off the trainer's critical path). With ``reward.service`` the worker does not
  wait for the scores: it submits the decoded samples to the shared reward actor and returns
  the reward ObjectRef in its result; the driver waits on it while this worker already
  generates its next unit. Before a unit of a newer version it loads that version's
  published weights, verified (:mod:`digenrl.engine.weight_sync`): received by broadcast on a
  background thread while it generated (``engine.weight_sync``), or from the object store.
- role ``trainer``: one rank of the trainer group. It holds no text encoder and no VAE (the
  samples carry the prompt embeddings and latents) unless it generates: TAG, or evaluation
  (:func:`generates`; a model reward's eval samples are scored on a rollout worker). Runs
  :func:`~digenrl.units.train.train_unit` (accumulating gradients), and on its StepUnit all-reduces the
  gradients in ~25 MiB buckets
  (gloo on CPU, nccl on GPU; per-tensor calls cost 5x more, docs/architecture.md) and steps; after an
  iteration's last step (mini-batch PPO: ``train.optimizer_steps`` per iteration) rank 0 publishes the
  new weights. With TAG it also rolls out, with its own weights (the scheduler hands it rollout units
  only while they are a published version: before the iteration's first step).
- role ``both`` (colocated): a trainer rank that also rolls out; the all-reduce keeps every
  rank's weights identical, so no weight sync is needed.

Each call returns its results plus timeline events (absolute ``time.time()`` spans measured
here, in the worker) that the driver records relative to the run start.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from digenrl.checkpoint.store import checkpoint_files, load_checkpoint
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.distributed.checkpointing import is_checkpointed
from digenrl.distributed.fsdp import all_reduce_replicas, forget_meshes
from digenrl.engine import sync_group, weight_sync
from digenrl.engine.faults import FaultInjector
from digenrl.engine.fsdp_group import combine_rank_stats, reshard, train_share
from digenrl.engine.groups import GroupMember, abort_process_group, group_call
from digenrl.engine.sp_group import SequenceParallelMember
from digenrl.engine.warm import posted_args
from digenrl.errors import UserError
from digenrl.placement.layout import RunLayout
from digenrl.policy.lora import checksum
from digenrl.policy.model import Policy, compile_transformer, pick_device
from digenrl.rewards import build_reward, scored_after_unit
from digenrl.rewards.service import Scored, reward_client
from digenrl.run.cadence import final_files
from digenrl.run.evaluate import evaluate_policy
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


class _TimedReward:
    """Wraps the (inline) reward so each call inside a rollout unit shows up as a "reward"
    event, with the seconds each component took."""

    def __init__(self, fn):
        self.fn, self.spans, self.calls = fn, [], []

    def __call__(self, *args):
        start = time.time()
        out = self.fn(*args)
        end = time.time()
        self.spans.append((start, end))
        self.calls.append({"seconds": end - start, "timings": dict(getattr(self.fn, "last_timings", {}))})
        return out


def _restarted() -> bool:
    """True in an actor that Ray has restarted after its process died."""
    import warnings

    try:
        import ray

        if not ray.is_initialized():  # not in a Ray actor (and do not start Ray by asking)
            return False
        with warnings.catch_warnings():  # (its implementation calls a deprecated Ray API)
            warnings.simplefilter("ignore")
            return ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # noqa: BLE001  (not in a Ray actor: a plain object, e.g. in tests)
        return False


class _SubmittedReward:
    """``reward.service``: hands the decoded samples to the reward actor and returns at once.
    The scores it returns are NaN placeholders (the samples travel to the trainer without
    them); the real ones arrive at the driver through ``refs`` (:class:`~digenrl.rewards.service.Scored`)."""

    def __init__(self, client):
        self.fn, self.refs = client, []
        self.label: str | None = None  # what is being scored: the unit's uid

    def __call__(self, pixels, prompts, metadata=None):
        self.refs.append(self.fn.submit_scored(pixels, prompts, metadata, self.label))
        return torch.full((len(prompts),), float("nan")), {}


class _DeferredReward:
    """A model reward scored after the unit (:func:`~digenrl.rewards.scored_after_unit`): inside the
    unit it keeps the decoded samples and returns NaN placeholders; :meth:`EngineWorker.score`, a
    side call that runs beside the worker's next unit, scores them with ``fn`` (None: a trainer rank
    with TAG, which never builds the reward -- a rollout worker scores its samples)."""

    def __init__(self, fn=None):
        self.fn, self.kept = fn, None

    def __call__(self, pixels, prompts, metadata=None):
        self.kept = (pixels, list(prompts), metadata)
        return torch.full((len(prompts),), float("nan")), {}


class _KeptForScoring:
    """A trainer rank's evaluation in a run that scores on its rollout workers: keeps every eval batch's
    decoded pixels (NaN placeholders as scores) for one :meth:`EngineWorker.score` on a rollout worker."""

    def __init__(self):
        self.kept: list[tuple] = []

    def __call__(self, pixels, prompts, metadata=None):
        self.kept.append((pixels.cpu(), list(prompts), list(metadata or [{}] * len(prompts))))
        return torch.full((len(prompts),), float("nan")), {}

    def joined(self) -> tuple:
        pixels, prompts, metadata = zip(*self.kept)
        return torch.cat(pixels), sum(prompts, []), sum(metadata, [])


@contextlib.contextmanager
def gc_paused_then_frozen():
    """Build with Python's cyclic garbage collector paused, then freeze what was built. A worker's
    start imports diffusers, peft and transformers and builds the model: some 10^5-10^6 objects that
    live as long as the worker, which the collector would traverse again and again while they are
    made (~20% of an engine worker's start-up CPU on 2 cores) and at every full collection after.
    Frozen objects are still freed by reference counting; :meth:`EngineWorker.retire` unfreezes
    before it collects the finished run's."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


#: the actor's concurrency group of :meth:`EngineWorker.score` (its other calls run one at a time, in order)
SCORE_GROUP = "score"
RETIRE_WAIT_S = 10.0  # warm workers: how long a retiring rollout worker waits for its weight-sync thread


@dataclass(frozen=True)
class ResumeFrom:
    """Where the workers start from: the checkpoint directory, and the driver's copy of the files a
    rollout worker needs (never ``optimizer.pt``) as an ObjectRef nested here, so Ray resolves it
    only in a worker that cannot read the directory."""

    path: str
    rollout_files: Any  # ray.ObjectRef of dict[str, bytes]


def rollout_checkpoint_files(path: Path) -> dict[str, bytes]:
    """The files of a checkpoint a rollout worker loads: all but the optimizer state."""
    return {f.name: f.read_bytes() for f in Path(path).iterdir() if f.is_file() and f.name != "optimizer.pt"}


def generates(cfg, role: str) -> bool:
    """Whether a worker of ``role`` ever encodes prompts or decodes latents: rollout and colocated
    workers, a trainer rank with TAG (it rolls out), and trainer ranks when ``output.eval_every``
    is set (rank 0 evaluates; every rank keeps them, as a rank does not know its rank at build)."""
    return role != "trainer" or cfg.engine.tag or cfg.output.eval_every > 0


class EngineWorker(GroupMember, SequenceParallelMember):
    """Plain class; the runtime wraps it with ``ray.remote`` and the pool's resources."""

    def __init__(
        self,
        cfg,
        name: str,
        role: str,
        reward_actor=None,
        resume: ResumeFrom | None = None,
        sp_follower: bool = False,
        layout: RunLayout | None = None,
        restart_from: tuple | None = None,
    ):
        """``resume``: the checkpoint to start from (read by path); ``sp_follower``: a rollout worker
        that follows its sequence-parallel group's lead (it scores nothing); ``layout``: the run's
        (:mod:`digenrl.placement.layout`), which this worker reads and never re-derives (None: a worker built
        outside a run, with a single process's settings); ``restart_from``: a warm actor's entry on
        its pool's board (:mod:`digenrl.engine.warm`): restarted by Ray, it builds the worker posted
        there (this run's), not the one it was created for."""
        if restart_from is not None and _restarted():
            args, kwargs = posted_args(restart_from)
            EngineWorker.__init__(self, *args, **kwargs)
            return
        self.cfg, self.name, self.role, self.layout = cfg, name, role, layout
        self.sp_follower = sp_follower
        self.resume_optimizer: str | None = None  # a sharded rank loads it once sharded (join_group)
        self.faults = FaultInjector.from_config(cfg, name)  # engine.faults: where this process dies
        # A config error raised here would reach the driver as an opaque ActorDiedError: keep it
        # and raise it from ready(), where Ray hands the driver the exception itself.
        self.init_error = None
        try:
            with gc_paused_then_frozen():
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
        if pick_device(cfg.train.device).type == "cpu":
            torch.set_num_threads(1)  # one thread per CPU worker: they share few cores with each other
        torch.manual_seed(cfg.train.seed)  # same construction order as LocalTrainer
        self.prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed)
        # this worker rolls out, so it scores (a sequence-parallel follower: its lead scores)
        scores = (self.role != "trainer" or cfg.engine.tag) and not self.sp_follower
        self.remote_reward = reward_actor is not None
        self.pending: dict[str, tuple] = {}  # a unit scored after it: uid -> its decoded samples
        self.eval_reward = None  # a trainer rank that evaluates builds the rewards then
        if self.remote_reward:  # reward.service: the reward models live in the shared actor only
            self.reward = _SubmittedReward(reward_client(cfg.reward, reward_actor))
        elif scores and scored_after_unit(cfg):  # a model reward: on rollout workers only, after the unit
            self.reward = _DeferredReward(build_reward(cfg.reward) if self.role == "rollout" else None)
            scores = self.reward.fn is not None
        elif scores:
            self.reward = _TimedReward(build_reward(cfg.reward))
        else:
            self.reward = None
        lean = not generates(cfg, self.role)  # a lean trainer rank: no text encoder, no VAE
        self.policy = Policy(  # a checkpoint: transformer alone
            cfg, trainable=self.role != "rollout", generates=not lean, layout=self.layout
        )
        if lean:  # a preset builds them all: release them
            self.policy.adapter.release_generation_modules()
        if cfg.engine.compile_rollout == "on" and self.role == "rollout":
            compile_transformer(self.policy, cfg.engine.compile_mode)
        self.expected_keys = frozenset(self.policy.weights())
        if scores and not _restarted():  # dry-run the rewards on this worker's decoded shape (once:
            # a restarted worker was checked at the start, and the reward actor may be restarting too)
            preflight_reward(self.reward.fn, self.policy.adapter, self.prompts.prompts)

    @group_call()
    def ready(self) -> dict:
        if self.init_error is not None:
            raise self.init_error
        weights = self.policy.weights()  # on a sharded group, a gather every rank joins
        return {
            "checksum": checksum(weights),
            "device": str(self.policy.device),
            "pid": os.getpid(),
            "version": self.policy.version,
        }

    # -- warm workers (digenrl.engine.warm): the same process, the next run ---------------------

    def rebuild(self, *args, **kwargs) -> dict:
        """Build the next run's worker in this live process (the constructor's arguments), as a
        fresh actor would; returns :meth:`ready`'s answer."""
        self.__dict__.clear()
        EngineWorker.__init__(self, *args, **kwargs)
        return self.ready()

    def retire(self) -> int | None:
        """The end of a run whose process is kept: leave its process groups, stop the weight-sync
        thread, drop everything it built. Returns this process's id, or None when something is
        still running in it (the driver then kills it)."""
        inbox = self.sync if isinstance(self.sync, sync_group.BroadcastInbox) else None
        if isinstance(self.sync, sync_group.BroadcastPublisher):
            self.sync.close()  # the receivers' threads end
        if inbox is not None and not inbox.stopped(timeout=RETIRE_WAIT_S):
            return None
        abort_process_group()
        forget_meshes()  # the next run's meshes may look equal to this one's with other coordinates
        self.__dict__.clear()
        gc.unfreeze()  # (what the run built was frozen: gc_paused_then_frozen)
        gc.collect()
        return os.getpid()

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
        events = []
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
            except sync_group.VersionMissed as exc:  # the driver sends the unit again, with the version
                return None, {"missed": unit.version, "why": str(exc)}
        cfg = self.cfg
        group = self.role != "rollout" and self.followers  # a trainer group generates each unit together
        everything = self.prompts.for_iteration(unit.iteration, cfg.train.prompts_per_iteration)
        deferred = isinstance(self.reward, _DeferredReward)
        if self.remote_reward:
            self.reward.refs.clear()
            self.reward.label = unit.uid
        elif not deferred:
            self.reward.spans.clear()
            self.reward.calls.clear()
        start = time.time()
        if group:  # every rank its share (fsdp_group.unit_share), scored here once
            samples = self.group_rollout(unit)
        else:
            samples = rollout_unit(
                self.policy,
                self.reward,
                [everything[g] for g in unit.groups],
                list(unit.groups),
                unit.iteration,
                cfg.train.seed,
                unit.sample_range(cfg.algorithm.group_size),
                self.policy.settings.sampling_batch(self.role),  # engine.rollout_batch (rollout workers)
            )
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
            )
        )
        if isinstance(self.sync, sync_group.BroadcastInbox):  # versions received meanwhile
            events += self.sync.drain_events()
        summary = {
            "rewards": samples.rewards,
            "reward_parts": samples.reward_parts,
            "terms": len(samples) * samples.train_idx.shape[1],  # (sample, trained step) terms
            "prompts": samples.prompts,
            "group_ids": samples.group_ids,
            "preview": samples.preview,  # first sample of each group, uint8: for the sample grids
            "version": samples.version,
            "events": events,
        }
        if self.remote_reward:  # scored in the reward actor: the driver waits for it, not this worker
            (summary["reward_ref"],) = self.reward.refs
            self.reward.refs.clear()
            del summary["rewards"], summary["reward_parts"]
        elif deferred:  # scored by score(): here (a rollout worker) or on a rollout worker (a TAG rank's)
            kept, self.reward.kept = self.reward.kept, None
            if self.reward.fn is not None:
                self.pending[unit.uid] = kept
                summary["score_on"] = self.name
            else:
                summary["pixels"] = (kept[0].cpu(), *kept[1:])
            del summary["rewards"], summary["reward_parts"]
        else:
            events += [
                unit_event("reward", unit, s, e, unit.version, service=False) for s, e in self.reward.spans
            ]
            summary["reward_calls"] = list(self.reward.calls)
        return samples, summary

    def score(self, uid: str, kept: tuple | None = None):
        """Score a rollout unit after it (a model reward): its decoded samples kept by :meth:`rollout`
        here, or ``kept`` (a TAG trainer rank's). Runs in the actor's ``score`` concurrency group,
        beside the worker's next unit on the same device; returns a
        :class:`~digenrl.rewards.service.Scored`, as the reward service does."""

        pixels, prompts, metadata = kept if kept is not None else self.pending.pop(uid)
        start = time.time()
        with torch.no_grad():  # (grad mode is per thread)
            total, parts = self.reward.fn(pixels, prompts, metadata)
        end = time.time()
        timings = dict(self.reward.fn.last_timings)
        return Scored(total, parts, start, end, timings, queue_depth=len(self.pending), pid=os.getpid())

    def holds_reward(self) -> bool:
        """Whether this worker built the reward models (the tests: trainer ranks never do)."""
        built = isinstance(self.reward, (_TimedReward, _DeferredReward)) and self.reward.fn is not None
        return built or self.eval_reward is not None

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
        digest = checksum(self.policy.weights()) if self.policy.lora else None  # ranks must agree
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
        a trainer rank holds no reward: it returns ``{"eval_pixels": (pixels, prompts, metadata)}`` and
        the driver has a rollout worker score them (:meth:`score`), as it does a TAG rank's units."""

        fn = getattr(self.reward, "fn", None)
        deferred = fn is None and scored_after_unit(self.cfg)
        if deferred:
            fn = _KeptForScoring()
        elif fn is None:  # a trainer rank that never scores (a function reward): the rewards for eval only
            if self.eval_reward is None:
                self.eval_reward = build_reward(self.cfg.reward)
            fn = self.eval_reward
        with self.policy.averaged():  # train.ema: the EMA weights
            metrics = evaluate_policy(self.policy, fn, self.prompts.prompts).metrics()
            if self.sharded:  # sampling leaves the root's parameters gathered (no backward frees them):
                reshard(self.policy.adapter.transformer)  # drop that copy before the weights swap back
        return {"eval_pixels": fn.joined()} if deferred else metrics

    @group_call()
    def export_final(self) -> dict[str, bytes]:
        """``final/``'s files (:func:`~digenrl.run.cadence.final_files`), as bytes for the driver, which
        writes them wherever its run directory is (possibly another node)."""
        return final_files(self.policy)  # gathers shards on every rank
