"""The engine's fault policy: what a dead process means for the run.

Details: docs/modules.md, `digenrl.engine.recovery`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter

from digenrl.engine import head_watch
from digenrl.engine.cluster import REWARD_ROW
from digenrl.engine.resources import head_problem
from digenrl.engine.stall import GroupStalled
from digenrl.errors import RunStopped, UserError, WeightSyncError, actor_death, first_line
from digenrl.schedule.driver import Back, Lost
from digenrl.units.types import RolloutUnit, Unit


class TrainerLost(RunStopped):
    """The run stopped with trainer rank 0's state gone (a dead rank, a dead head): nothing newer than
    the last checkpoint on disk can be kept."""


class TrainerRankLost(TrainerLost):
    """A trainer rank -- or a member of its shard / sequence-parallel group -- died running unit ``uid``
    (the cluster is fine): the run may go on from the last checkpoint (``engine.trainer_restarts``,
    :func:`digenrl.launch.run_engine`). ``run_dir``: the run's directory, set when the run stops."""

    def __init__(self, message: str, uid: str):
        super().__init__(message)
        self.uid, self.run_dir = uid, None


RESTART_POLL_S = 0.5  # how often to ask a restarting worker whether it is back
HEAD_PROBE_S = 2.0  # how often the driver checks that the cluster's head still answers


class FaultRecovery:
    def __init__(self, roles: dict[str, str], max_restarts: int):
        self.roles, self.max_restarts = roles, max_restarts
        self.restarts: Counter[str] = Counter()  # worker -> times it died and was restarted
        self.restarting: dict[str, float] = {}  # worker -> when to ask it for ready() again
        self.start_checksum: str | None = None  # the weights every (re)started worker must hold
        self.last_probe = time.time()

    def died(self, worker: str, unit: Unit, exc: Exception) -> Lost:
        """``worker`` died running ``unit`` (or, for the reward row, the unit's scores were lost):
        the unit to generate again, or RunStopped."""
        self.check_head(now_please=True)  # a dead head takes every actor along: that is not a worker fault
        limit = self.max_restarts
        if worker == REWARD_ROW:
            import ray

            if not isinstance(exc, ray.exceptions.ObjectLostError):
                raise RunStopped(
                    f"the reward actor died and was not restarted (engine.max_restarts: {limit}; "
                    f"{first_line(exc, typed=True)}); the run stopped."
                )
            print(
                f"warning: the scores of {unit.uid} were lost with the worker that submitted them; "
                "generating it again",
                file=sys.stderr,
            )
            return Lost(unit)
        if self.roles[worker] != "rollout" or not isinstance(unit, RolloutUnit):
            raise TrainerRankLost(
                f"trainer rank {worker} died while running {unit.uid} ({first_line(exc, typed=True)}); "
                "the run stopped.",
                unit.uid,
            )
        self.restarts[worker] += 1
        if self.restarts[worker] > limit:
            raise RunStopped(
                f"rollout worker {worker} died {self.restarts[worker]} times (engine.max_restarts: "
                f"{limit}); the run stopped."
            )
        print(
            f"warning: rollout worker {worker} died in {unit.uid}; restarting it "
            f"({self.restarts[worker]} of {limit}) and generating {unit.uid} again",
            file=sys.stderr,
        )
        self.restarting[worker] = time.time() + RESTART_POLL_S  # asked to report ready once rebuilt
        return Lost(unit, worker)

    def due_for_ready(self) -> list[str]:
        """The restarting workers to ask for ready() now (Ray answers once it has rebuilt them)."""
        now = time.time()
        due = [w for w, at in self.restarting.items() if at <= now]
        for worker in due:
            del self.restarting[worker]
        return due

    def ready_answer(self, worker: str, get) -> Back | None:
        """``get()`` returns a restarting worker's ready() answer or raises: ``Back`` when it is
        rebuilt with the run's starting weights, None while it is still restarting."""
        import ray

        try:
            ready = get()
        except ray.exceptions.ActorUnavailableError:  # still restarting: ask again later
            self.restarting[worker] = time.time() + RESTART_POLL_S
            return None
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise RunStopped(
                f"{worker} did not come back after a restart ({first_line(exc, typed=True)}); "
                "the run stopped."
            ) from None
        if ready["checksum"] != self.start_checksum:
            raise WeightSyncError(f"{worker} restarted with other weights than the run started with")
        return Back(worker)

    def wait_timeout(self) -> float:
        """How long the driver may wait for a result before it must look after restarts or the head."""
        return RESTART_POLL_S if self.restarting else HEAD_PROBE_S

    def check_head(self, now_please: bool = False) -> None:
        """Every HEAD_PROBE_S (or now): does the cluster's head (GCS) still accept connections?"""
        now = time.time()
        if now - self.last_probe < HEAD_PROBE_S and not now_please:
            return
        self.last_probe = now
        lost = head_lost()
        if lost is not None:
            raise lost


def head_lost() -> TrainerLost | None:
    """The error a run stops with when the cluster's head (GCS) no longer accepts connections, or None.
    A dead head may first surface as whatever Ray call it broke (an actor "unavailable", a lost
    object): the driver asks this before reporting such an error."""
    problem = head_problem()
    if problem is None:
        return None
    import ray

    head_watch.noticed()  # the driver reports it: the watch stands down
    return TrainerLost(head_watch.head_error(ray.get_runtime_context().gcs_address, problem))


class GroupRestart:
    """Sequence-parallel rollout groups (``engine.rollout_sp``): one worker of many devices. A lost
    member takes its group down -- the driver kills the group's other members, so Ray restarts every
    one (the lost one it restarts itself) -- and once the lead answers ``ready()`` again the group
    is formed again whole (``form(names)``: its own world, the lead taking its followers) before the
    lead takes work; its unit was re-queued once, as any dead rollout worker's
    (:meth:`FaultRecovery.died`)."""

    def __init__(
        self, groups: dict[str, list[str]], actors: dict, form, timeout_s: float = 1800.0, stall=None
    ):
        self.groups, self.actors, self.form = groups, actors, form  # lead -> its members, lead first
        self.down: set[str] = set()
        self.timeout_s = timeout_s  # engine.group_timeout_s
        self.seen: dict = {}  # in-flight call -> when the driver first saw it running
        self.stall = stall  # engine.stall_timeout_s: a StallWatch (engine/stall.py), or None
        self.why: dict[str, Exception] = {}  # a worker taken down for a stalled member -> that stall

    def watch(self, in_flight: dict, roles: dict[str, str], busy: set[str] = frozenset()) -> list[str]:
        """The driver's own check for a blocked member (never a peer's error: an NCCL peer waits
        without raising): a call running longer than ``timeout_s``, or a member of a busy worker's
        group that stopped answering (``stall``; ``busy``: workers busy besides ``in_flight``'s),
        takes its worker's group down -- an SP rollout group whole, a trainer rank with every
        trainer rank (one process group) -- and its call then fails as a death does, handled as
        one. Returns the workers taken down."""
        import ray

        now = time.time()
        self.seen = {ref: self.seen.get(ref, now) for ref in in_flight}
        overdue = [ref for ref, at in self.seen.items() if at is not None and now - at > self.timeout_s]
        for ref in overdue:  # (taken down once: its failure is on its way)
            self.seen[ref] = None
        hung = {in_flight[ref][0] for ref in overdue}
        for worker in hung & set(roles):
            print(
                f"warning: {worker}'s group has run one call for over {self.timeout_s:.0f} s "
                "(engine.group_timeout_s): a member is blocked; taking the group down",
                file=sys.stderr,
            )
        if self.stall is not None:
            stalled = self.stall.check(({w for w, _ in in_flight.values()} | set(busy)) & set(roles))
            self.why.update({w: GroupStalled(line) for w, line in stalled.items()})
            hung |= set(stalled)
        down = set()
        for worker in hung & set(roles):  # (not the reward actor's scoring: Ray restarts that one)
            if roles[worker] != "rollout":
                down |= {w for w, role in roles.items() if role != "rollout"}
            else:
                down |= set(self.groups.get(worker, [worker]))
        for name in sorted(down):
            with contextlib.suppress(Exception):
                ray.kill(self.actors[name], no_restart=False)
        return sorted(down)

    def cause(self, worker: str, exc: Exception) -> Exception:
        """Why ``worker``'s call failed with ``exc`` (a death): the stall it was taken down for, if any."""
        return self.why.pop(worker, exc)

    def take_down(self, lead: str, exc: Exception) -> None:
        """``lead``'s unit failed because a member of its group died (``exc``): restart the rest."""
        import ray

        if lead not in self.groups:
            return
        dead = getattr(actor_death(exc), "actor_id", None)
        for name in self.groups[lead]:
            actor = self.actors[name]
            if actor._actor_id.hex() != dead:  # (Ray restarts the dead one already)
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=False)
        self.down.add(lead)

    def reform(self, lead: str) -> None:
        """``lead`` is back: its group forms again (every member waits until Ray has restarted it)."""
        if lead in self.down:
            self.down.discard(lead)
            self.form(self.groups[lead])


@contextlib.contextmanager
def user_errors():
    """A UserError / WeightSyncError raised inside an actor reaches the caller as itself."""
    try:
        yield
    except Exception as exc:
        cause = own_error(exc)
        if cause is not exc:
            raise cause from None
        raise


def own_error(exc: BaseException) -> BaseException:
    """The UserError / WeightSyncError an actor raised, out of Ray's wrapper (else ``exc``)."""
    import ray

    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    return cause if isinstance(cause, (UserError, WeightSyncError)) else exc
