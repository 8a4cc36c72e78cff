"""A sequence-parallel rollout worker (``engine.rollout_sp: s``): s devices, one lead and s - 1
hidden followers, running the transformer with Ulysses over their own torch.distributed group
(:mod:`digenrl.distributed.sequence_parallel`). The scheduler sees the lead only; the lead hands
each rollout unit to its followers, which generate the same samples with it (the same seeds; every
transformer call exchanges tokens within the group) and score nothing."""

from __future__ import annotations

from datetime import timedelta

import torch

from digenrl.engine import weight_sync
from digenrl.units import rollout_unit


def _unscored(pixels, prompts, metadata=None):
    """A follower's reward: none (its lead scores the same samples)."""
    return torch.zeros(len(prompts)), {}


class SequenceParallelMember:
    """The calls an :class:`~digenrl.engine.workers.EngineWorker` answers as a member of a
    sequence-parallel rollout group."""

    sp_world = 1  # devices this worker's transformer runs over (its rollout events record it)

    def join_sp_group(self, address: str, port: int, rank: int, world: int, backend: str) -> None:
        """Join this rollout worker's group (its own torch.distributed world) and run the
        transformer sequence-parallel over it."""
        import torch.distributed as dist

        from digenrl.distributed import sequence_parallel as sp

        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(minutes=30))
        sp.enable_sequence_parallel(self.policy.adapter.transformer, sp.sp_mesh(world, self.policy.device.type))
        self.sp_world = world

    def sp_rollout(self, unit, packet: weight_sync.WeightPacket | None) -> None:
        """A follower's share of its lead's rollout unit (the lead's :meth:`rollout` starts it):
        the same generation, with that version's weights; returns nothing."""
        if unit.version != self.policy.version:
            weight_sync.load(self.policy, packet, self.expected_keys, unit.iteration)
        cfg = self.cfg
        everything = self.prompts.for_iteration(unit.iteration, cfg.train.prompts_per_iteration)
        rollout_unit(self.policy, _unscored, [everything[g] for g in unit.groups], list(unit.groups),
                     unit.iteration, cfg.train.seed, unit.sample_range(cfg.algorithm.group_size))
