"""Starting an engine run: its layout resolved once, then run on Ray (the workers' first build is the
dry run of what they hold: a failure there is the run's one-line error, before anything is written).
The layer above the runtime: :mod:`digenrl.engine.runtime` runs what it is handed."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from digenrl.config.run import RunConfig
from digenrl.engine.faults import with_fault_plan
from digenrl.engine.recovery import TrainerRankLost
from digenrl.engine.resources import PlacementError
from digenrl.errors import UserError
from digenrl.placement.layout import RunLayout
from digenrl.placement.resolve import resolve
from digenrl.placement.tag_choice import with_tag

if TYPE_CHECKING:
    from digenrl.checkpoint.compat import CheckpointState


def run_engine(
    cfg: RunConfig,
    run_dir: Path | None = None,
    on_iteration: Callable[[dict], None] | None = None,
    ray_address: str | None = None,
    resume: Path | None = None,
    layout: RunLayout | None = None,
    resumed: CheckpointState | None = None,
):
    """Train ``cfg`` on Ray with placement ``cfg.placement.mode`` (colocated | disaggregated), as
    its ``layout`` (default: resolved here) says; see :func:`digenrl.engine.runtime.run_on_ray`.

    ``resume`` (a run or checkpoint directory) starts every worker from the latest complete
    checkpoint. A trainer rank (or a member of its group) that dies stops the run; with
    ``engine.trainer_restarts`` the run then goes on from its last checkpoint, every worker started
    again, as ``--resume`` would (the iterations after it are run again: nothing lost, nothing
    trained twice). ``resumed``: the checkpoint's state, when the caller has read it (``digenrl
    train`` does, once) instead of ``resume``. Returns the :class:`~digenrl.run.cadence.RunResult`."""
    from digenrl.checkpoint.load import read_state
    from digenrl.checkpoint.store import find_checkpoint, latest_checkpoint
    from digenrl.engine.runtime import run_on_ray

    if cfg.placement.mode == "local":
        raise UserError("placement.mode: 'local' runs without the engine (use LocalTrainer)")
    if resumed is None and resume is not None:
        resumed = read_state(find_checkpoint(resume))
    start = resumed.iteration if resumed is not None else 0
    if start > cfg.train.iterations:
        raise UserError(
            f"--resume: the checkpoint has {start} iterations done, more than train.iterations "
            f"({cfg.train.iterations})"
        )
    layout = layout or resolve(cfg)
    if cfg.engine.tag is None and layout.plan is not None:  # unset: as the layout settled it
        cfg = with_tag(cfg, layout.plan.tag)
    cfg = with_fault_plan(cfg)  # the environment's faults too: the actors may not see it
    lost = None  # the stop a restart is for
    for restart in itertools.count(1):
        try:
            return run_on_ray(cfg, layout, resumed, run_dir, on_iteration, ray_address)
        except PlacementError as exc:
            if lost is None:
                raise
            raise UserError(f"{lost[0]}; the run stopped: {exc}; {lost[1]}") from None
        except TrainerRankLost as exc:
            with_nodes(exc)
            last = latest_checkpoint(exc.run_dir) if exc.run_dir is not None else None
            if restart > cfg.engine.trainer_restarts or last is None:
                raise
            what, _, hint = str(exc).partition("; the run stopped; ")
            lost = (what, hint)
            print(
                f"warning: {what}; restarting every worker from "
                f"{last} ({restart} of {cfg.engine.trainer_restarts}, engine.trainer_restarts)",
                file=sys.stderr,
            )
            resumed, run_dir = read_state(last), None  # the checkpoint's run directory goes on
            cfg = without_faults(cfg, exc.uid)  # a fault fires once per run


def with_nodes(exc: TrainerRankLost) -> None:
    """A trainer rank lost with its node: the message names the node first (what must come back)."""
    gone = getattr(exc, "nodes_gone", None)
    if gone:
        exc.args = (f"{' and '.join(gone)} left the Ray cluster: {exc}",)


def without_faults(cfg: RunConfig, uid: str) -> RunConfig:
    """``cfg`` without the faults of unit ``uid`` (``uid`` or ``uid:start``, on any worker): they fired,
    and a run restarted from a checkpoint starts new processes, which would fire them again."""
    faults = [f for f in cfg.engine.faults if f.unit.split(":")[0] != uid]
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"faults": faults})})
