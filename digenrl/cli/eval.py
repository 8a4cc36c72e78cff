"""``digenrl eval``: check the inputs, sample with a progress bar, print the reward table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from digenrl.cli.tables import show


def run_eval(
    checkpoint: Path | None,
    config: Path | None,
    prompts: Path | None,
    baseline: str | None,
    out: Path | None,
    console: Console,
) -> dict:
    from digenrl.run.evaluate import evaluate_checkpoint, prepare_eval

    job = prepare_eval(checkpoint, config, prompts, baseline, out)  # every input checked: UserError
    n = len(job.prompts) * (2 if job.baseline is not None else 1)
    progress = Progress(
        TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )
    from digenrl.cli.liblog import library_output_beside

    with library_output_beside(console, lambda: job.out / "log.txt"), progress:
        task = progress.add_task("eval", total=n)
        report = evaluate_checkpoint(job, on_batch=lambda k: progress.advance(task, k))
    if "ema" in report:  # the checkpoint kept an EMA of the weights (train.ema): that is what was sampled
        e = report["ema"]
        console.print(
            f"using the EMA weights of {Path(report['checkpoint']).name} (decay {e.get('decay')}, "
            f"every {e.get('every')} of {e.get('steps')} optimizer steps)",
            soft_wrap=True,
        )
    show(console, reward_table(report))  # whole words; piped: one line a row
    files = [report["grid"], *([report["comparison"]] if "comparison" in report else [])]
    console.print(
        f"{len(job.prompts)} prompts, {report['eval_steps']} ODE steps, {report['seconds']:.1f} s; "
        f"wrote {job.out / 'eval.json'}, {', '.join(files)}"
    )
    return report


def reward_table(report: dict) -> Table:
    base = report.get("baseline")
    version = "weights export" if report["version"] is None else f"version {report['version']}"
    table = Table(title=f"{Path(report['checkpoint']).name} ({version})")
    table.add_column("reward")
    table.add_column("checkpoint", justify="right")
    if base:
        table.add_column(f"baseline ({Path(base['source']).name})", justify="right")
        table.add_column("difference", justify="right")
    for name, r in report["rewards"].items():
        cells = [name, _mean_std(r)]
        if base:
            d = report["difference"][name]
            cells += [_mean_std(base["rewards"][name]), "n/a" if d is None else f"{d:+.4f}"]
        table.add_row(*cells)
        for tag, mean in r.get("by_tag", {}).items():  # prompts tagged as GenEval's: the mean per tag
            theirs = base["rewards"][name]["by_tag"].get(tag) if base else None
            row = [f"  {tag}", _mean(mean)] + ([_mean(theirs), ""] if base else [])
            table.add_row(*row)
        if "tag_mean" in r:
            table.add_row(
                "  mean of tags",
                _mean(r["tag_mean"]),
                *([_mean(base["rewards"][name].get("tag_mean")), ""] if base else []),
            )
    return table


def _mean(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _mean_std(r: dict) -> str:
    return "n/a (all NaN)" if r["mean"] is None else f"{r['mean']:.4f} ± {r['std']:.4f}"
