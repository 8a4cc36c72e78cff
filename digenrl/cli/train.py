"""``digenrl train``: pick the driver the placement asks for, show progress, print a summary."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from digenrl.config import RunConfig


def run_train(cfg: RunConfig, run_dir: Path | None, ray_address: str | None, console: Console,
              resume: Path | None = None):
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(), console=console,
    )
    resumed = None
    if resume is not None:
        from digenrl.checkpoint import find_checkpoint, read_state

        resumed = read_state(find_checkpoint(resume))
    with console.status("building model, reward and prompts..."):
        if cfg.placement.mode == "local":
            from digenrl.trainer import LocalTrainer

            driver = LocalTrainer(cfg, resume=resume)
            start = lambda cb: driver.run(run_dir, cb)  # noqa: E731
        else:
            from digenrl.engine.runtime import run_engine

            start = lambda cb: run_engine(cfg, run_dir, cb, ray_address=ray_address, resume=resume)  # noqa: E731
    done = resumed.iteration if resumed is not None else 0
    if resumed is not None:
        console.print(f"resuming from {resumed.path} (iteration {done} of {cfg.train.iterations})")
    if done >= cfg.train.iterations:
        console.print(f"nothing to do: the run already completed {done} of {cfg.train.iterations} iterations "
                      "(extend it with --set train.iterations=N)")
    with progress:
        task = progress.add_task("train", total=cfg.train.iterations, completed=done, stats="")

        def on_iteration(row: dict) -> None:
            progress.update(task, advance=1, stats=(
                f"reward {row['reward_mean']:.4f}  loss {row['loss']:+.2e}  {row['wall_s']:.2f} s/it"))

        result = start(on_iteration)
    rows = result.metrics
    if not rows:
        console.print(f"run directory: {result.run_dir}")
        return
    k = max(1, len(rows) // 3)
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    console.print(f"reward (mean of first third -> last third): {first:.4f} -> {last:.4f} ({last - first:+.4f})")
    console.print(f"run directory: {result.run_dir}")
