"""An engine worker's process groups: the trainer ranks' group (replicated ranks' bucketed
gradient all-reduce, FSDP2 / HSDP shard groups whose lead fans every call out to its other ranks,
sequence-parallel trainer ranks) and the weight-sync group (``engine.weight_sync: broadcast``).
A mixin of :class:`~digenrl.engine.workers.EngineWorker`; the driver forms the groups
(:mod:`digenrl.engine.cluster`)."""

from __future__ import annotations

import functools
import socket
from datetime import timedelta

from digenrl.engine import sync_group
from digenrl.engine.fsdp_group import shard_trainer_rank


def group_call(follower_method: str | None = None):
    """Run a worker method as its group's one call (verl's worker-group dispatch): the lead first
    starts the same call -- or ``follower_method``, a follower's share of it -- with the same
    arguments on each of its followers (:meth:`GroupMember.lead`), runs its own share, and waits for
    theirs before it returns. Inside, :meth:`GroupMember.followers_done` waits early and returns the
    followers' results in order (a method that needs them, or must wait before a step of its own)."""

    def wrap(method):
        name = follower_method or method.__name__

        @functools.wraps(method)
        def run(self, *args, **kwargs):
            self._pending = [getattr(f, name).remote(*args, **kwargs) for f in self.followers]
            out = method(self, *args, **kwargs)
            self.followers_done()
            return out

        return run

    return wrap


class GroupMember:
    """A worker's membership of its process groups. What it needs from the worker:"""

    cfg: object  # the RunConfig
    layout: object  # the run's RunLayout (digenrl.layout): ranks, groups, degrees
    name: str
    policy: object  # digenrl.policy.Policy
    resume_optimizer: str | None  # a sharded rank loads the optimizer state once sharded
    enable_sp: object  # (SequenceParallelMember) run the transformer over a sequence-parallel group
    # what it sets up
    world: int = 1  # trainer ranks in the group joined (1: none)
    rank: int = 0
    sharded: bool = False  # a rank of an FSDP2 shard group
    degree: int = 1  # the shard group's size
    mesh = None  # the shard group's device mesh
    followers: list = []  # a lead's followers (actor handles), which run every group_call with it
    sync = None  # engine.weight_sync broadcast: rank 0's publisher or a rollout worker's inbox
    _pending: list = []  # the followers' refs of the group_call in progress

    # -- trainer group -------------------------------------------------------------------

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_group(self, address: str, port: int, rank: int, world: int, backend: str) -> None:
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=30),
        )
        self.world, self.rank = world, rank
        me = self.layout.worker(self.name)  # what this rank does: the run's layout, never re-derived
        if me.fsdp == 1 and rank != 0:  # train.ema, replicated ranks: rank 0 alone keeps the average (it
            self.policy.ema = (
                None  # evaluates, checkpoints, exports); sharded ranks each average their shards
            )
        if me.fsdp > 1:  # FSDP2 over shard groups of `fsdp` ranks (HSDP when several)
            self.mesh = shard_trainer_rank(self.policy, me.fsdp, self.resume_optimizer)
            self.sharded, self.resume_optimizer, self.degree = True, None, me.fsdp
        if me.sp > 1:  # groups of trainer_sp consecutive ranks (layout.trainer_sp_groups)
            self.enable_sp(me.sp)

    def lead(self, followers: dict) -> None:
        """The lead of a sharded or sequence-parallel group (``followers``: name -> actor, the
        layout's followers of this worker): it runs every :func:`group_call` on them too (same call,
        same collectives), so the scheduler sees the group as this one worker."""
        expected = self.layout.followers_of(self.name)
        if tuple(followers) != expected:
            raise RuntimeError(
                f"{self.name}: asked to lead {list(followers)}, the layout says {list(expected)}"
            )
        self.followers = list(followers.values())

    def followers_done(self) -> list:
        """Wait for the followers' share of the group call in progress; their results, in order."""
        refs, self._pending = self._pending, []
        if not refs:
            return []
        import ray

        return ray.get(refs)

    def _all_reduce_gradients(self) -> None:
        """Sum the accumulated gradients over the ranks in DDP-style buckets
        (:func:`~digenrl.distributed.grad_sync.all_reduce_gradients`: ~25 MiB each, packed while the
        previous one is in flight; never a flat copy of every gradient). A rank that trained nothing
        this iteration contributes zeros (its grads are None)."""
        if self.world == 1:
            return
        from digenrl.distributed import grad_sync

        grad_sync.all_reduce_gradients(self.policy.params)

    # -- weight-sync group (engine.weight_sync: broadcast) --------------------------------

    def sync_specs(self) -> dict:
        """This worker's device and what a weight sync writes here (names, shapes, dtypes)."""
        return {"device": str(self.policy.device), "specs": sync_group.receiver_specs(self.policy)}

    def join_sync(self, address: str, port: int, rank: int, world: int, backend: str, specs=None) -> None:
        """Join the weight-sync group (rank 0: trainer rank 0, given the rollout workers' ``specs``)."""
        self.sync = sync_group.join(
            self.policy, address, port, rank, world, backend, specs, self.cfg.engine.max_staleness
        )

    def leave_sync(self) -> None:
        self.sync = None

    def export_staged(self, version: int):
        """A version this worker sent (trainer rank 0) or received by broadcast, for a restarted
        rollout worker outside the group."""
        return sync_group.staged_copy(self.sync, version, self.name)
