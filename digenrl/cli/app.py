"""The ``digenrl`` command line. It only parses, loads a config and calls one function per command."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from digenrl.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False, help=(
    "DigenRL: online RL post-training (Flow-GRPO, DanceGRPO) for diffusion / flow-matching generators "
    "on disaggregated hardware."))
config_app = typer.Typer(help="Show or validate a run configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
console = Console()
err = Console(stderr=True)

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML run config (default: the embedded tiny FLUX demo).")
SetOpt = typer.Option(None, "--set", "-s", help="Override a value: dotted.key=value (repeatable).")


def _load(config: Optional[Path], sets: Optional[List[str]]):
    from digenrl.config import load_config

    return load_config(config, sets or [])


@app.command()
def train(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[List[str]] = typer.Option(None, "--set", "-s", help="Override: dotted.key=value (repeatable)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run directory (default runs/<name>-<time>)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Join an existing Ray cluster."),
    resume: Optional[Path] = typer.Option(None, "--resume", help=(
        "Continue RUN_DIR from its latest complete checkpoint, or from CHECKPOINT_DIR; the config is the "
        "checkpoint's unless -c, with --set on top (e.g. train.iterations=N to extend the run).")),
):
    """Train with online RL. With no arguments: the tiny FLUX colour demo on this CPU."""
    from digenrl.cli.train import run_train

    if resume is not None:
        from digenrl.checkpoint import find_checkpoint

        resume = find_checkpoint(resume)
        config = config or resume / "config.yaml"
    cfg = _load(config, set_)
    run_train(cfg, run_dir, ray_address, console, resume=resume)


@config_app.command("show")
def config_show(config: Optional[Path] = ConfigOpt, set_: Optional[List[str]] = SetOpt):
    """Print the resolved config (defaults <- file <- --set) as YAML."""
    cfg = _load(config, set_)
    console.print(cfg.dump_yaml(), end="", markup=False, highlight=False)


@config_app.command("validate")
def config_validate(config: Optional[Path] = ConfigOpt, set_: Optional[List[str]] = SetOpt):
    """Check a config; exit 2 with the offending dotted path on error."""
    cfg = _load(config, set_)
    from digenrl.preflight import check_memory  # the placement fits its devices

    check_memory(cfg)
    console.print(f"ok: {config or 'embedded default'} ({cfg.model.adapter}, {cfg.algorithm.name}, "
                  f"placement {cfg.placement.mode})")


@app.command()
def profile(
    config: Optional[Path] = ConfigOpt,
    device: str = typer.Option("cpu", help="cpu | cuda"),
    out: Path = typer.Option(Path("profile.json"), help="Where to write the profile."),
    engine: Optional[str] = typer.Option(None, help=(
        "The engine's own overheads: none (the model only), ray (Ray micro-benchmarks: call, object-store "
        "transfer, all-reduce) or run (ray + a short calibration run of the engine). Default: ray on cpu, "
        "none on cuda.")),
    repeats: int = typer.Option(5, help="Timed calls per measurement (the median is kept)."),
):
    """Measure rollout / train step times vs batch size, decode, reward, weight-sync and memory on this device."""
    from digenrl.cli.profile import run_profile_command

    run_profile_command(_load(config, None), device, out, console, engine=engine, repeats=repeats)


@app.command()
def plan(
    config: Optional[Path] = ConfigOpt,
    cluster: Optional[Path] = typer.Option(None, help="Cluster file (pools of device types and counts)."),
    profile_file: Optional[Path] = typer.Option(None, "--profile", help="A profile.json to calibrate the cost model."),
    top: int = typer.Option(5, help="How many placements to show."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    write: Optional[Path] = typer.Option(None, help="Write the best plan as a config for `digenrl train`."),
    iterations: int = typer.Option(4, help="Iterations simulated per plan (the first and last are not measured)."),
    timeline: Optional[Path] = typer.Option(None, help=(
        "Write the predicted timeline.json / timeline.png of the best plan (DIR/best) and of the best "
        "colocated plan (DIR/colocated).")),
    ladder: bool = typer.Option(False, "--ladder", help=(
        "Also show what GAP, TSP, TAG and one-step async each add: the best plan with the knobs "
        "switched on one by one.")),
):
    """Search placements (pool split, unit size, TSP, TAG, staleness) by simulating the engine's scheduler."""
    from digenrl.cli.plan import run_plan_command

    run_plan_command(_load(config, None), cluster, profile_file, top, json_out, write, console,
                     iterations=iterations, timeline_dir=timeline, ladder=ladder)


@app.command("eval")
def eval_(
    checkpoint: Optional[Path] = typer.Option(None, help="Checkpoint directory, or a run directory (its latest)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c",
                                          help="YAML run config (default: the checkpoint's config.yaml)."),
    prompts: Optional[Path] = typer.Option(None, help="Eval prompt file (default: the config's prompts)."),
    baseline: Optional[str] = typer.Option(None, help="'base' (the initial weights) or another checkpoint dir."),
    out: Optional[Path] = typer.Option(None, help="Output directory (default RUN/eval/iter-NNNNNN)."),
):
    """Evaluate a checkpoint with ODE sampling and fixed seeds; write eval.json and image grids."""
    from digenrl.cli.eval import run_eval

    run_eval(checkpoint, config, prompts, baseline, out, console)


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2, no traceback."""
    # library chatter (e.g. transformers' "requires torchvision" notes) would bury our one-line errors
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    try:
        app()  # standalone: usage errors exit 2, typer.Exit its code
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)  # one line, never wrapped
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except SystemExit as exc:  # typer turns Ctrl-C into a silent exit 130, after our cleanup ran
        if exc.code == 130:
            print("interrupted", file=sys.stderr)
        raise


if __name__ == "__main__":
    main()
