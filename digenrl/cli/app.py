"""The ``digenrl`` command line. It only parses, loads a config and calls one function per command."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from digenrl.errors import RunInterrupted, UserError

# rich_markup_mode=None: plain --help (no boxes, no <bool> after flags that take no value)
app = typer.Typer(
    add_completion=False,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help=(
        "DigenRL: online RL post-training (Flow-GRPO, DanceGRPO) for diffusion / flow-matching "
        "generators on disaggregated hardware."
    ),
)
config_app = typer.Typer(help="Show or validate a run configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
console = Console()
err = Console(stderr=True)

ConfigOpt = typer.Option(
    None,
    "--config",
    "-c",
    help=("YAML run config, layered on the defaults (the tiny FLUX demo, configs/flux_tiny.yaml)."),
)
SetOpt = typer.Option(None, "--set", "-s", help="Override a value: dotted.key=value (repeatable).")


def _load(config: Optional[Path], sets: Optional[List[str]]):
    from digenrl.config.run import load_config

    return load_config(config, sets or [])


@app.command()
def train(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[List[str]] = typer.Option(
        None, "--set", "-s", help="Override: dotted.key=value (repeatable)."
    ),
    run_dir: Optional[Path] = typer.Option(
        None,
        "--run-dir",
        help=(
            "Run directory (default runs/<name>-<time>); an existing run there is refused unless --overwrite."
        ),
    ),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Join an existing Ray cluster."),
    resume: Optional[Path] = typer.Option(
        None,
        "--resume",
        help=(
            "Continue RUN_DIR from its latest complete checkpoint, or from CHECKPOINT_DIR; the config is the "
            "checkpoint's unless -c, with --set on top (e.g. train.iterations=N to extend the run)."
        ),
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --run-dir (deletes it)."),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress display; only the summary and errors."
    ),
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help=("Show library messages (Ray, torch) on the terminal instead of routing them to RUN/log.txt."),
    ),
):
    """Train with online RL. With no arguments: the tiny FLUX colour demo on this CPU."""
    if quiet and verbose:
        raise UserError("--quiet and --verbose: choose one")
    if not quiet:
        console.print("digenrl train: loading the config...", highlight=False)
    from digenrl.cli.train import run_train

    edited = None
    if resume is not None:
        from digenrl.checkpoint.store import find_checkpoint

        resume = find_checkpoint(resume)
        if config is None and run_dir is None and resume.parent.name == "checkpoints":
            edited = resume.parent.parent  # continues in its own directory: RUN/config.yaml must match
        config = config or resume / "config.yaml"
    cfg = _load(config, set_)
    if edited is not None:
        from digenrl.run.resume import check_resume_config

        check_resume_config(edited, config, set_ or [])  # an edit of RUN/config.yaml is never ignored
    run_train(
        cfg,
        run_dir,
        ray_address,
        console,
        checkpoint=resume,
        overwrite=overwrite,
        quiet=quiet,
        verbose=verbose,
    )


@config_app.command("show")
def config_show(config: Optional[Path] = ConfigOpt, set_: Optional[List[str]] = SetOpt):
    """Print the resolved config (defaults <- file <- --set) as YAML."""
    cfg = _load(config, set_)
    console.print(cfg.dump_yaml(), end="", markup=False, highlight=False)


@config_app.command("validate")
def config_validate(
    config: Optional[Path] = ConfigOpt,
    set_: Optional[List[str]] = SetOpt,
    ray_address: Optional[str] = typer.Option(
        None,
        "--ray-address",
        help=("The Ray cluster train will join (its devices are then checked by train, not here)."),
    ),
    schema_only: bool = typer.Option(
        False, "--schema-only", help="Only the config's own schema (no files, no model)."
    ),
):
    """The preflight: everything `train` would reject (schema, placement against this host, model shapes,
    preset or checkpoint, LoRA targets, prompts and reward), in seconds; exit 2 with one line on error."""
    cfg = _load(config, set_)
    checked = ["schema"]
    if not schema_only:
        from digenrl.data.prompts import check_prompts
        from digenrl.placement.preflight import check_config
        from digenrl.placement.resolve import resolve

        with console.status("checking placement, model, prompts and reward..."):
            layout = resolve(cfg)  # in train's order: the layout (the placement's memory first), the prompts
            check_prompts(cfg)  # with the limit the text encoder implies, as train checks them
            checked += check_config(cfg, layout, ray_address)
        console.print(
            "\n".join(["layout (written to RUN/layout.json by train):", *layout.describe()]),
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
    console.print(
        f"ok: {config or 'the defaults'} ({cfg.model.adapter}, {cfg.algorithm.name}, "
        f"placement {cfg.placement.mode}); checked {'; '.join(checked)}",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def profile(
    config: Optional[Path] = ConfigOpt,
    device: str = typer.Option("cpu", help="cpu | cuda"),
    out: Path = typer.Option(Path("profile.json"), help="Where to write the profile."),
    engine: Optional[str] = typer.Option(
        None,
        help=(
            "The engine's own overheads: none (the model only), ray (Ray micro-benchmarks: call, "
            "object-store transfer, all-reduce) or run (ray + a short calibration run of the engine). "
            "Default: ray on cpu, none on cuda."
        ),
    ),
    repeats: int = typer.Option(5, help="Timed calls per measurement (the median is kept)."),
    cpu_sharing: int = typer.Option(
        3,
        help=(
            "CPU only: measure what 2..N concurrent workers get of this host's cores (the planner's "
            "cpu_slowdown); 0 skips it (the planner then shares the cores evenly)."
        ),
    ),
):
    """Measure rollout / train step times vs batch size, decode, reward, weight-sync and memory on this
    device."""
    from digenrl.cli.profile import run_profile_command
    from digenrl.run.rundir import check_output_file

    check_output_file(out, "--out")
    run_profile_command(
        _load(config, None), device, out, console, engine=engine, repeats=repeats, sharing=cpu_sharing
    )


@app.command()
def plan(
    config: Optional[Path] = ConfigOpt,
    cluster: Optional[Path] = typer.Option(None, help="Cluster file (pools of device types and counts)."),
    profile_file: Optional[Path] = typer.Option(
        None, "--profile", help="A profile.json to calibrate the cost model."
    ),
    top: int = typer.Option(5, help="How many placements to show."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    write: Optional[Path] = typer.Option(None, help="Write the best plan as a config for `digenrl train`."),
    iterations: int = typer.Option(
        4, help="Iterations simulated per plan (the first and last are not measured)."
    ),
    timeline: Optional[Path] = typer.Option(
        None,
        help=(
            "Write the predicted timeline.json / timeline.png of the best plan (DIR/best) and of the best "
            "colocated plan (DIR/colocated)."
        ),
    ),
    ladder: bool = typer.Option(
        False,
        "--ladder",
        help=(
            "Also show what GAP, TSP, TAG and one-step async each add: the best plan with the knobs "
            "switched on one by one."
        ),
    ),
    show_peers: bool = typer.Option(
        False,
        "--peers",
        help=(
            "Also show each peer as it runs (veRL-Omni colocated / separate_async, DanceGRPO, flow_grpo: "
            "their published arrangements with their structural costs) beside the best plan."
        ),
    ),
):
    """Search placements (pool split, unit size, TSP, TAG, staleness) by simulating the engine's scheduler."""
    from digenrl.cli.plan import run_plan_command
    from digenrl.run.rundir import check_output_file, check_writable

    if write is not None:
        check_output_file(write, "--write")
    if timeline is not None:
        check_writable(timeline, "--timeline")
    run_plan_command(
        _load(config, None),
        cluster,
        profile_file,
        top,
        json_out,
        write,
        console,
        iterations=iterations,
        timeline_dir=timeline,
        ladder=ladder,
        show_peers=show_peers,
    )


@app.command("eval")
def eval_(
    checkpoint: Optional[Path] = typer.Option(
        None, help="Checkpoint directory, or a run directory (its latest)."
    ),
    config: Optional[Path] = typer.Option(
        None, "--config", "-c", help="YAML run config (default: the checkpoint's config.yaml)."
    ),
    prompts: Optional[Path] = typer.Option(None, help="Eval prompt file (default: the config's prompts)."),
    baseline: Optional[str] = typer.Option(
        None, help="'base' (the initial weights) or another checkpoint dir."
    ),
    out: Optional[Path] = typer.Option(None, help="Output directory (default RUN/eval/iter-NNNNNN)."),
):
    """Evaluate a checkpoint with ODE sampling and fixed seeds; write eval.json and image grids."""
    from digenrl.cli.eval import run_eval

    run_eval(checkpoint, config, prompts, baseline, out, console)


@app.command()
def report(
    run: Path = typer.Argument(..., help="The run directory."),
    out: Optional[Path] = typer.Option(None, help="Where to write the page (default RUN/report.html)."),
):
    """One HTML page of a run that opens offline: reward curves per component, samples, timeline."""
    from digenrl.run.report import write_report
    from digenrl.run.rundir import check_output_file

    if out is not None:
        check_output_file(out, "--out")
    console.print(f"wrote {write_report(run, out)}", highlight=False, soft_wrap=True)


def main() -> None:
    """Console entry point: user errors and usage errors become one line on stderr and exit code 2,
    no traceback."""
    # library chatter (e.g. transformers' "requires torchvision" notes) would bury our one-line errors
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    try:
        code = app(prog_name="digenrl", standalone_mode=False)  # Click's errors come to us, not its box
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)  # one line, never wrapped
        sys.exit(exc.exit_code)
    except RunInterrupted as exc:  # Ctrl-C mid-run: what was kept, how to resume
        print(exc, file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:
        if _is(exc, "Abort"):  # Click's form of Ctrl-C
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        if _is(exc, "NoArgsIsHelpError"):  # `digenrl config`: its help, as --help shows it
            print(exc.ctx.get_help())
            sys.exit(0)
        if not _is(exc, "UsageError"):
            raise
        print(f"error: {usage_error(exc)}", file=sys.stderr)
        sys.exit(2)
    if code == 130:  # Typer turns Ctrl-C into exit code 130, after our cleanup ran
        print("interrupted", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


def _is(exc: BaseException, name: str) -> bool:
    """Whether ``exc`` is Click's ``name`` exception (Typer vendors its own copy of Click's classes)."""
    return any(c.__name__ == name and "click" in c.__module__ for c in type(exc).__mro__)


def usage_error(exc) -> str:
    """A Click usage error as ``<option or command>: <what>``, pointing to --help."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "digenrl"
    hint = f" (see {where} --help)"
    message = " ".join(exc.format_message().split())
    if _is(exc, "NoSuchOption"):
        return f"{exc.option_name}: no such option of `{where}`{hint}"
    if _is(exc, "BadOptionUsage") and "requires an argument" in message:
        return f"{exc.option_name}: needs a value{hint}"
    param = getattr(exc, "param", None)
    if _is(exc, "BadParameter") and param is not None:
        names = "/".join(getattr(param, "opts", []) or [param.name or "argument"])
        return f"{names}: {exc.message}{hint}"
    return f"{where}: {message[:1].lower()}{message[1:]}{hint}"


def run() -> None:
    """The ``digenrl`` executable: :func:`main`, then exit as soon as everything is written. The
    interpreter's own teardown of torch and Ray takes seconds after the last line (measured ~4 s on
    2 cores) and does nothing for the user: exit handlers run and the output is flushed first."""
    import atexit

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if "ray" in sys.modules:  # a run stopped by a dead head: Ray's exit handler would wait for it
        from digenrl.engine.resources import forget_dead_head

        forget_dead_head()
    atexit._run_exitfuncs()  # Ray's and W&B's handlers, as a normal exit would run them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
