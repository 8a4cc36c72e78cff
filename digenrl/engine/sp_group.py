"""Sequence-parallel workers (``engine.rollout_sp`` / ``engine.trainer_sp: s``): s devices, one lead
and s - 1 hidden followers, running the transformer with Ulysses over their group
(:mod:`digenrl.distributed.sequence_parallel`). The scheduler sees the lead only.

Details: docs/modules.md, `digenrl.engine.sp_group`.
"""

from __future__ import annotations

from datetime import timedelta

from digenrl.distributed import sequence_parallel as sp
from digenrl.engine import sync_group, weight_sync
from digenrl.engine.groups import group_share
from digenrl.units.rollout import rollout_unit


class SequenceParallelMember:
    """The calls an :class:`~digenrl.engine.workers.EngineWorker` answers as a member of a
    sequence-parallel group."""

    # what it needs from the worker
    cfg: object  # the RunConfig
    policy: object  # digenrl.policy.model.Policy
    prompts: object  # digenrl.data.prompts.PromptSampler
    expected_keys: frozenset  # the weight names a sync must carry
    sync = None  # engine.weight_sync broadcast: this member's inbox (None: the object store)
    # what it sets up
    sp_world = 1  # devices this worker's transformer runs over (its rollout / train events record it)

    def join_sp_group(self, address: str, port: int, rank: int, world: int, backend: str) -> None:
        """Join this rollout worker's group (its own torch.distributed world) and run the
        transformer sequence-parallel over it."""
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=30),
        )
        self.enable_sp(world)

    def enable_sp(self, degree: int) -> None:
        """Run the transformer with Ulysses over this rank's group of ``degree`` consecutive ranks
        of the (joined) default process group: a rollout group's own world, or the trainer ranks'."""

        sp.enable_sequence_parallel(
            self.policy.adapter.transformer, sp.sp_mesh(degree, self.policy.device.type)
        )
        self.sp_world = degree

    def any_member_missed(self, missed: bool) -> bool:
        """Whether any member of this sequence-parallel rollout group missed a unit's version by broadcast
        (one all-reduce, before the unit's collectives): then none generates and the lead answers
        "missed", where a lone member's miss would leave the others waiting in an all-to-all."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([float(missed)], device=self.policy.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @group_share
    def sp_rollout(self, unit, packet: weight_sync.WeightPacket | None) -> None:
        """A follower's share of its lead's rollout unit (the lead's :meth:`rollout` starts it):
        the same generation, with that version's weights; returns nothing."""
        self.faults.reached(f"{unit.uid}:start")  # engine.faults: dies while its lead waits in the unit
        missed = False
        if unit.version != self.policy.version:  # the lead's packet (object store), else this member's inbox
            try:
                weight_sync.load_version(
                    self.policy, unit.version, unit.iteration, packet, self.sync, self.expected_keys
                )
            except sync_group.VersionMissed:
                missed = True
        if self.any_member_missed(missed):  # the lead answers "missed": the unit comes again, with the
            return None  # version from the object store
        if isinstance(self.sync, sync_group.BroadcastInbox):  # a follower's prefetches stay off the timeline
            self.sync.drain_events()
        cfg = self.cfg
        everything = self.prompts.for_iteration(unit.iteration, cfg.train.prompts_per_iteration)
        rollout_unit(  # (its lead scores the same samples)
            self.policy,
            [everything[g] for g in unit.groups],
            list(unit.groups),
            unit.iteration,
            cfg.train.seed,
            unit.sample_range(cfg.algorithm.group_size),
            self.policy.settings.sampling_batch(self.role),  # the lead's batch: the same collectives
        )
        self.faults.reached(unit.uid)  # engine.faults: a member dies mid-unit, taking its group down
