"""``digenrl train``: check the run directory, pick the driver the placement asks for, show progress
from the first second, route library output to ``RUN/log.txt``, print a summary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from digenrl.config.run import RunConfig


@dataclass(frozen=True)
class TrainJob:
    """One ``digenrl train``, decided before it starts: each fact found once, then handed down whole."""

    cfg: RunConfig
    run_dir: Path  # where it writes
    continuing: bool  # a resumed run appending to its own directory (else a new directory)
    resumed: object  # the checkpoint's CheckpointState, or None
    ray_address: str | None
    overwrite: bool


def planned_run_dir(cfg: RunConfig, run_dir: Path | None, resumed) -> Path:
    """Where the run will write: --run-dir, output.run_dir, the resumed run's own directory, or
    runs/<name>-<time> (the drivers resolve it the same way)."""
    from digenrl.run.rundir import default_run_dir

    if run_dir is not None:
        return Path(run_dir)
    if resumed is not None:
        return Path(resumed.run_dir or resumed.path)
    return Path(cfg.output.run_dir or default_run_dir(cfg))


def run_train(
    cfg: RunConfig,
    run_dir: Path | None,
    ray_address: str | None,
    console: Console,
    checkpoint: Path | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    verbose: bool = False,
):
    """``checkpoint``: the checkpoint directory to resume from (found by the caller)."""
    from digenrl.checkpoint.load import read_state
    from digenrl.run.lock import claim_run_dir

    resumed = read_state(checkpoint) if checkpoint is not None else None
    continuing = resumed is not None and run_dir is None  # a resumed run appends to its own directory
    job = TrainJob(cfg, planned_run_dir(cfg, run_dir, resumed), continuing, resumed, ray_address, overwrite)
    # one run per directory: taken before anything slow, held to the end (digenrl/run/lock.py)
    with claim_run_dir(job.run_dir, "--resume" if continuing else "--run-dir"):
        return _run_claimed(job, console, quiet, verbose)


def _run_claimed(job: TrainJob, console: Console, quiet: bool, verbose: bool):
    from digenrl.data.prompts import check_prompts
    from digenrl.placement.preflight import check_resources
    from digenrl.placement.resolve import resolve
    from digenrl.progress import listening
    from digenrl.run.rundir import check_new_run_dir, keep_log, library_output_to_log

    cfg, target, continuing, resumed = job.cfg, job.run_dir, job.continuing, job.resumed
    if not continuing:
        check_new_run_dir(target, job.overwrite)  # before any work: a run is never overwritten by accident
    layout = resolve(cfg)  # the run's layout, once: memory against its device types, before this host's
    check_prompts(cfg)  # a prompt the text encoder or a caption cannot take: refused now, in seconds
    check_resources(cfg, job.ray_address)
    done = resumed.iteration if resumed is not None else 0
    say = (lambda *a: None) if quiet else (lambda text: console.print(text, soft_wrap=True, highlight=False))
    if resumed is not None:
        say(f"resuming from {resumed.path} (iteration {done} of {cfg.train.iterations})")
    if done >= cfg.train.iterations:
        say(
            f"nothing to do: the run already completed {done} of {cfg.train.iterations} iterations "
            "(extend it with --set train.iterations=N)"
        )
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
    )
    result, replaced, restored = None, None, False
    with library_output_to_log(console, enabled=not verbose) as log:
        try:
            with progress, listening(lambda stage: progress.update(task, stats=stage)):
                task = progress.add_task("train", total=cfg.train.iterations, completed=done, stats="")
                start = _driver(job, layout)
                if job.overwrite and not continuing:
                    replaced = _set_aside(target)

                last = {"stats": ""}

                def on_iteration(row: dict) -> None:
                    last["stats"] = (
                        f"reward {row['reward_mean']:.4f}  loss {row['loss']:+.2e}  {row['wall_s']:.2f} s/it"
                    )
                    progress.update(task, advance=1, stats=last["stats"])
                    if replaced is not None:
                        replaced.commit_if_safe()  # the new run's first checkpoint: the old run goes

                result = start(on_iteration)
                progress.update(task, stats=last["stats"])  # the bar ends on the last iteration, not a stage
        except BaseException as exc:
            restored = replaced is not None and replaced.finish()
            if restored and isinstance(exc, Exception):
                _note_restored(exc, target)
            raise
        else:
            if replaced is not None:
                replaced.drop()  # the new run finished (with its last checkpoint): the old one goes
        finally:
            # bad input (or a restored old run): write nothing
            started = not restored and (result is not None or (target / "config.yaml").exists())
            kept = keep_log(log, (result.run_dir if result is not None else target) if started else None)
    _summary(result, console, kept, cfg)
    return result


def _driver(job: TrainJob, layout):
    """The driver the placement asks for, built (local: model, reward and prompts) and ready to run."""
    from digenrl.placement.preflight import check_model, check_rewards
    from digenrl.progress import progress

    cfg, run_dir = job.cfg, None if job.continuing else job.run_dir
    progress("loading torch and the model code...")
    check_model(cfg)  # shapes, checkpoint directory, LoRA targets (meta device): seconds, before Ray starts
    check_rewards(cfg)  # names, args and files of the rewards (no model loaded), as config validate does
    if cfg.placement.mode == "local":
        from digenrl.engine.local import LocalTrainer

        progress("building model, reward and prompts...")

        driver = LocalTrainer(cfg, layout=layout, resumed=job.resumed)
        progress("training...")
        return lambda cb: driver.run(run_dir, cb)
    from digenrl.launch import run_engine

    progress("starting the engine...")
    return lambda cb: run_engine(cfg, run_dir, cb, job.ray_address, layout=layout, resumed=job.resumed)


def _set_aside(target: Path):
    """--overwrite: move the old run into RUN/.replaced/ (deleted once the new run has a checkpoint,
    moved back if it fails before that); None when RUN holds nothing to replace."""
    from digenrl.progress import progress
    from digenrl.run.lock import ReplacedRun, run_entries

    if not run_entries(target):
        return None
    progress("setting the old run aside (kept until the new run's first checkpoint)...")
    replaced = ReplacedRun(target)
    replaced.set_aside()
    return replaced


def _note_restored(exc: Exception, target: Path) -> None:
    """The failed run's message says that the run it would have replaced is back."""
    from digenrl.errors import RunInterrupted, UserError

    note = (
        f"the old run in {target} was kept (--overwrite replaces it only once the new run has a checkpoint)"
    )
    if isinstance(exc, (UserError, RunInterrupted)):  # their message is the user's one line
        exc.args = (f"{str(exc).rstrip('. ')}; {note}",)
    else:
        exc.add_note(note)


def _summary(result, console: Console, log: Path | None, cfg: RunConfig) -> None:
    """The last lines, also under -q (a flat run's: which metric points at the cause)."""
    from digenrl.run.diagnose import diagnosis

    def say(text: str) -> None:
        console.print(text, soft_wrap=True, highlight=False)

    rows = result.metrics
    if rows:
        k = max(1, len(rows) // 3)
        first = sum(r["reward_mean"] for r in rows[:k]) / k
        last = sum(r["reward_mean"] for r in rows[-k:]) / k
        say(f"reward (mean of first third -> last third): {first:.4f} -> {last:.4f} ({last - first:+.4f})")
        why = diagnosis(rows, cfg.algorithm.clip_range, cfg.algorithm.kl_beta)
        if why is not None:
            say(why)
    if log:
        say(f"library messages (Ray, torch): {log}")
    say(f"run directory: {result.run_dir}")
