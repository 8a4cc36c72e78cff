"""An engine worker's process groups: the trainer ranks' group (replicated ranks' bucketed
gradient all-reduce, FSDP2 / HSDP shard groups whose lead fans every call out to its other ranks,
sequence-parallel trainer ranks) and the weight-sync group (``engine.weight_sync: broadcast``).
A mixin of :class:`~digenrl.engine.workers.EngineWorker`; the driver forms the groups
(:mod:`digenrl.engine.cluster`)."""

from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta

from digenrl.distributed import grad_sync
from digenrl.engine import fsdp_group, sync_group
from digenrl.engine.fsdp_group import shard_trainer_rank
from digenrl.errors import actor_died

FOLLOWER_WAIT_S = 10.0  # a lead whose call failed: how long it waits for its followers' errors


def abort_process_group() -> None:
    """Tear this process's torch.distributed group down: its peers' pending collectives fail at once
    (gloo: the connection closes) instead of waiting the group's timeout for passes that never come."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _consequence(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer aborted or died (not a cause)."""
    import torch.distributed as dist

    exc = getattr(exc, "cause", None) or exc  # (a follower's, out of Ray's wrapper)
    text = str(exc)
    return isinstance(exc, dist.DistError) or "closed by peer" in text or "reset by peer" in text


def group_share(method):
    """A follower's share of its lead's :func:`group_call` (a method only followers run): when it
    fails, the follower aborts its process group, so the lead's collectives fail too (no hang)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception:
            abort_process_group()
            raise

    return run


def group_call(follower_method=None):
    """Run a worker method as its group's one call (verl's worker-group dispatch): the lead first
    starts the same call -- or ``follower_method``, a follower's share of it -- with the same
    arguments on each of its followers (:meth:`GroupMember.lead`), runs its own share, and waits for
    theirs before it returns. Inside, :meth:`GroupMember.followers_done` waits early and returns the
    followers' results in order (a method that needs them, or must wait before a step of its own).
    ``follower_method`` may be a function of the lead, returning the method's name."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            name = follower_method or method.__name__
            if callable(name):  # a follower's share that depends on the lead (its role)
                name = name(self)
            self._pending = [getattr(f, name).remote(*args, **kwargs) for f in self.followers]
            try:
                out = method(self, *args, **kwargs)
            except Exception as exc:  # one member failed: the group's collectives cannot match any more
                cause = self.group_failed(exc)
                if cause is exc:
                    raise
                raise cause from exc
            self.followers_done()
            return out

        return run

    return wrap


class GroupMember:
    """A worker's membership of its process groups. What it needs from the worker:"""

    cfg: object  # the RunConfig
    layout: object  # the run's RunLayout (digenrl.placement.layout): ranks, groups, degrees
    name: str
    policy: object  # digenrl.policy.model.Policy
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
    faults: object  # digenrl.engine.faults.FaultInjector: where this process dies (engine.faults)
    _pending: list = []  # the followers' refs of the group_call in progress

    def alive(self) -> int:
        """The driver's ping (engine/stall.py), answered in the ``health`` concurrency group beside
        whatever this worker runs: this process's id."""
        return os.getpid()

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
            timeout=timedelta(seconds=self.cfg.engine.group_timeout_s),  # NCCL's watchdog too
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

    def group_failed(self, exc: Exception) -> BaseException:
        """A group call raised ``exc`` here; the error to raise. A follower aborts its process group
        (:func:`abort_process_group`: its lead may wait in a collective for it). A lead waits for its
        followers' share of the call -- aborting the group first if they are still running after
        FOLLOWER_WAIT_S, waiting in a collective for it -- and names what ended the call: a follower
        that died (the driver restarts its group, :class:`~digenrl.engine.recovery.GroupRestart`),
        else a follower's own error when ``exc`` is only a collective that lost its peer, else
        ``exc``. A group whose members all returned stays formed (the run may still checkpoint)."""
        import ray

        refs, self._pending = self._pending, []
        if not refs:  # a follower, or a worker of no group (or a lead whose followers already answered)
            if self.layout is not None and self.name in self.layout.leads:
                abort_process_group()
            return exc
        done, stuck = ray.wait(refs, num_returns=len(refs), timeout=FOLLOWER_WAIT_S)
        if stuck:  # followers waiting in a collective for this lead's share: end it
            abort_process_group()
            done += ray.wait(stuck, num_returns=len(stuck), timeout=FOLLOWER_WAIT_S)[0]
        errors = []
        for ref in done:
            try:
                ray.get(ref)
            except Exception as err:  # noqa: BLE001  (any follower error may be the cause)
                errors.append(err)
        died = [e for e in errors if actor_died(e)]
        causes = [e for e in errors if not _consequence(e)]
        if died:
            return died[0]
        return causes[0] if causes and _consequence(exc) else exc

    def _generation_share(self) -> tuple[int, int]:
        """(this rank's share, the shares) of a unit its trainer group generates: one per sequence-parallel
        group of a shard group (its members generate the same share together), one in all unsharded."""
        if not self.sharded:
            return 0, 1
        return (self.rank % self.degree) // self.sp_world, self.degree // self.sp_world

    @group_share
    def rollout_share(self, unit, packet=None):
        """A trainer group follower's share of its lead's rollout unit (:meth:`group_rollout`; the
        lead's ``rollout`` group call starts it, with its arguments: a trainer rank needs no packet)."""
        self.faults.reached(f"{unit.uid}:start")  # engine.faults: dies while its lead waits in the unit
        return fsdp_group.rollout_share(self, unit, *self._generation_share())

    def group_rollout(self, unit):
        """A trainer group's lead generates ``unit`` with its group (TAG, colocated): every rank its
        share (:func:`~digenrl.engine.fsdp_group.unit_share`; a sequence-parallel group one share
        together), parameters gathered per forward as in training, so the collectives match; the
        lead merges the shares into the unit's (samples, decoded), scored like any other unit's (the
        followers' shares: the ``rollout`` group call started them)."""
        mine = fsdp_group.rollout_share(self, unit, *self._generation_share())
        parts = ([mine] + self.followers_done())[:: self.sp_world]  # SP members repeat their share
        return fsdp_group.merge_shares(parts, unit, self.cfg.algorithm.group_size)

    def _all_reduce_gradients(self) -> None:
        """Sum the accumulated gradients over the ranks in DDP-style buckets
        (:func:`~digenrl.distributed.grad_sync.all_reduce_gradients`: ~25 MiB each, packed while the
        previous one is in flight; never a flat copy of every gradient). A rank that trained nothing
        this iteration contributes zeros (its grads are None)."""
        if self.world == 1:
            return

        grad_sync.all_reduce_gradients(self.policy.params)

    # -- weight-sync group (engine.weight_sync: broadcast) --------------------------------

    def sync_specs(self) -> dict:
        """This worker's device and what a weight sync writes here (names, shapes, dtypes)."""
        return {"device": str(self.policy.device), "specs": sync_group.receiver_specs(self.policy)}

    def join_sync(self, address: str, port: int, rank: int, world: int, backend: str, specs=None) -> None:
        """Join the weight-sync group (rank 0: trainer rank 0, given the rollout workers' ``specs``);
        again after a restart (:meth:`~digenrl.engine.weight_sync.SyncRoutes.rejoin`): the old group
        is closed and the versions this member staged carry over."""
        old = self.sync
        if isinstance(old, sync_group.BroadcastPublisher):
            old.close()  # the old group's receivers stop waiting
        staleness = self.cfg.engine.max_staleness
        self.sync = sync_group.join(
            self.policy, address, port, rank, world, backend, specs, staleness, self.faults
        )
        sync_group.carry_over(old, self.sync)

    def republish(self, live: bool = True) -> dict:
        """Trainer rank 0, once the weight-sync group re-formed: send the version it holds over the new
        group, once (a sharded group's other ranks join the gathers). Not with mini-batch PPO, whose
        earlier steps move the weights without a new version: then nothing is sent (``event`` None)."""
        if self.rank == 0:
            live = self.cfg.train.optimizer_steps == 1
        self._pending = [
            f.republish.remote(live) for f in self.followers
        ]  # (rank 0's live, not a group_call's)
        event = None
        if self.rank > 0 and live:
            sync_group.take_part(self.policy, "broadcast")
        elif live:
            event = self.sync.publish(self.policy)
            event.update(uid=f"sync-{event['version']}-republish", args={**event["args"], "rejoin": True})
        self.followers_done()
        return {"version": self.policy.version, "event": event}

    def leave_sync(self) -> None:
        self.sync = None

    def export_staged(self, version: int):
        """A version this worker sent (trainer rank 0) or received by broadcast, for a restarted
        rollout worker outside the group."""
        return sync_group.staged_copy(self.sync, version, self.name)
