"""What the engine's dispatcher (:class:`~digenrl.engine.runtime.RayBackend`) does around the
optimizer steps: trainer rank 0's side calls after a step (eval, checkpoint), stopping mid-run
(Ctrl-C, a fatal error: the running units finish, the last completed iteration is checkpointed),
and the run's outputs (``final/``, the timeline)."""

from __future__ import annotations

import sys

from digenrl.checkpoint.optimizer import staging_dir
from digenrl.checkpoint.store import save_checkpoint_files
from digenrl.config.run import RunConfig
from digenrl.engine import head_watch
from digenrl.engine.recovery import (
    TrainerLost,
    TrainerRankLost,
    head_lost,
    own_error,
)
from digenrl.engine.workers import SCORE_GROUP
from digenrl.errors import WeightSyncError, first_line
from digenrl.progress import progress
from digenrl.run.cadence import (
    checkpoint_to_keep,
    stopped,
)
from digenrl.run.evaluate import eval_metrics
from digenrl.schedule.driver import finish_running


class AroundSteps:
    """Rank 0's side calls, stopping and outputs, as a part of the dispatcher (its attributes)."""

    cfg: RunConfig
    actors: dict  # worker name -> Ray actor
    rank0: str  # trainer rank 0's worker
    side: dict  # ObjectRef -> (what, iteration or worker): rank 0's eval / checkpoint, a ready()
    in_flight: dict  # ObjectRef -> (worker, unit)
    role: dict  # worker name -> role
    hidden: set  # followers: their lead runs their calls

    # -- rank 0's side calls: eval and checkpoint after a step -------------------------------

    def after_step(self, k: int) -> set[str]:
        """Ask rank 0 for iteration k's eval / checkpoint now: it has just stepped to version k+1
        and gets no other work before these calls run (an actor runs its calls in order). Returns
        the names the metrics row of k waits for."""
        rank0, names = self.actors[self.rank0], set()
        if self.cadence.eval_due(k):
            self.side[rank0.evaluate.remote()] = ("eval", k)
            names.add(f"eval-{k}")
        if self.cadence.checkpoint_due(k):
            self.side[
                rank0.checkpoint.remote(k + 1, self.checkpoint_extra(), staging_dir(self.out.path, k + 1))
            ] = ("checkpoint", k)
            names.add(f"checkpoint-{k}")
        return names

    def side_busy(self) -> set[str]:
        """The workers busy with a side call: rank 0 (and its group) in an eval or checkpoint."""
        side = {what for what, _ in self.side.values()}
        return {self.rank0} if side & {"eval", "checkpoint"} else set()

    def side_done(self, ref):
        import ray

        what, key = self.side.pop(ref)
        if what == "restart":
            back = self.faults.ready_answer(key, lambda: ray.get(ref))
            if back is not None:
                self.groups.reform(key)  # a sequence-parallel group restarted whole forms again
            if back is not None and not self.faults.restarting:  # the last one back: the group re-forms
                event = self.sync.rejoin(key)
                if event is not None:
                    self.record(self.rank0, [event])
            return back
        if what == "eval":
            metrics = self.side_result(ref, what, key)
            if "eval_decoded" in metrics:  # a model reward: a rollout worker scores rank 0's eval samples
                scorer = self.scorers[key % len(self.scorers)]
                call = self.actors[scorer].score.options(concurrency_group=SCORE_GROUP)
                self.side[call.remote(f"eval-{key}", metrics["eval_decoded"])] = ("eval_scored", key)
                return None
            self.ledger.evaluated(key, metrics)
        elif what == "eval_scored":
            scored = ray.get(ref)
            self.ledger.evaluated(key, eval_metrics(scored.total, scored.parts))
        else:
            self.ledger.checkpointed(key, self.side_result(ref, what, key))
        return None

    def side_result(self, ref, what: str, key: int):
        """Rank 0's answer to a side call; its process (or node) gone: the trainer rank is lost, as in a
        unit (the run stops, or restarts from the last checkpoint: ``engine.trainer_restarts``)."""
        import ray

        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            lost = head_lost()  # a dead head takes every actor along: that is not a lost trainer rank
            if lost is not None:
                raise lost from None
            raise TrainerRankLost(
                f"trainer rank {self.rank0} died while running {what}-{key} "
                f"({first_line(self.groups.cause(self.rank0, exc), typed=True)}); "
                "the run stopped.",
                f"{what}-{key}",
            ) from None

    def drain(self) -> None:
        """Wait for the side calls still running after the last step (the last eval / checkpoint)."""
        import ray

        while self.side:
            (ref,), _ = ray.wait(list(self.side), num_returns=1)
            self.side_done(ref)

    def checkpoint_extra(self) -> dict:
        return {
            "driver": "engine",
            "placement": self.cfg.placement.mode,
            "max_staleness": self.cfg.engine.max_staleness,
        }

    # -- stopping mid-run: Ctrl-C, fatal errors ------------------------------------------------

    def keep_work(self, exc: BaseException) -> BaseException:
        """The run stops on ``exc`` (Ctrl-C, or an error). Unless trainer rank 0's state is gone (a dead
        rank or head, ranks out of sync) or Ctrl-C was pressed twice: the running units finish, every
        iteration whose step is done gets its row, and rank 0 checkpoints the last completed
        iteration. Returns the exception to raise, naming the last checkpoint and how to resume."""
        import ray

        exc = own_error(exc)
        if isinstance(exc, ray.exceptions.RayError):  # a dead head surfaces first as whichever call it broke
            exc = head_lost() or exc
        if isinstance(exc, KeyboardInterrupt) and head_watch.woke():  # no Ctrl-C: the head watch's
            exc = head_lost() or exc
        if isinstance(exc, TrainerRankLost):  # where a restart (engine.trainer_restarts) resumes from
            exc.run_dir = self.out.path
        if not (self.stop.forced or isinstance(exc, (TrainerLost, WeightSyncError))):
            self.stopping = True
            try:
                progress(
                    "stopping: finishing the running units, then a checkpoint (Ctrl-C again: stop now)..."
                )
                self.finish_running()
                self.checkpoint_last()
            except KeyboardInterrupt:  # a second Ctrl-C: stop now, with what is on disk
                pass
            except Exception as again:  # noqa: BLE001 -- the first error is the one to report
                print(f"warning: could not keep the work in progress: {again!r}", file=sys.stderr)
        return self.explained(exc)

    def explained(self, exc: BaseException) -> BaseException:
        """``exc`` naming the last checkpoint and how to resume (``run.cadence.stopped``)."""
        return stopped(exc, self.out.path, self.iterations_logged(), self.cfg.train.iterations)

    def iterations_logged(self) -> int:
        rows = self.ledger.rows
        return rows[-1]["iteration"] + 1 if rows else self.sched.cfg.start_iteration

    def finish_running(self) -> None:
        """No new work: wait for the units and side calls in flight (handing the other ranks their
        share of a collective step one rank has begun), as the driver loop would. A unit that fails
        now is dropped; the rows it held back are written without it."""
        self.faults.restarting.clear()
        self.side = {ref: what for ref, what in self.side.items() if what[0] != "restart"}
        ranks = [w for w, role in self.role.items() if role != "rollout" and w not in self.hidden]

        def owed_step_shares() -> list[str]:
            begun = self.open_steps()
            started = self.step_shares[begun[-1]] if begun else set()
            busy = {w for w, _ in self.in_flight.values()}
            return [r for r in ranks if started and r not in started and r not in busy]

        finish_running(self.sched, self, owed_step_shares, lambda: bool(self.in_flight or self.side))
        for name in {n for waiting in self.ledger.waiting.values() for n in waiting}:
            self.ledger.finished(name)  # nothing runs any more: what a row still waits for will not come

    def open_steps(self) -> list[tuple[int, int]]:
        """The optimizer steps (iteration, step) handed out of the iteration not yet published, in order."""
        return sorted(key for key in self.step_shares if key[0] == self.sched.published_version)

    def checkpoint_last(self) -> None:
        """Rank 0's checkpoint of the last completed iteration, when it holds exactly that version."""
        import ray

        done = self.iterations_logged()
        if (
            self.open_steps()
        ):  # mini-batch PPO: rank 0 took a step of an unfinished iteration; keep what is on disk
            return
        if checkpoint_to_keep(self.out.path, done, self.sched.published_version):
            files = ray.get(
                self.actors[self.rank0].checkpoint.remote(
                    done, self.checkpoint_extra(), staging_dir(self.out.path, done)
                )
            )
            save_checkpoint_files(self.out.path, done, files, self.cfg.output.keep_last)

    # -- outputs -------------------------------------------------------------------------------

    def final_files(self) -> dict[str, bytes]:
        """``final/`` from trainer rank 0's weights (:func:`~digenrl.run.cadence.final_files`)."""
        import ray

        return ray.get(self.actors[self.rank0].export_final.remote())

    def save_timeline(self) -> None:
        if self.timeline.events:
            path, timeline = self.out.path / "timeline.json", self.timeline
            if self.resumed_at is not None:  # resumed: the whole run's timeline, not this part's
                timeline = timeline.after_earlier(path, self.resumed_at)
            timeline.save_json(path)
            timeline.to_png(self.out.path / "timeline.png")
