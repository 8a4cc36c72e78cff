"""Starting an engine run: resolve its layout once, check what the workers will build, run it on Ray.

The layer above the runtime that may call the memory model (through :func:`digenrl.resolve.resolve`)
and the preflight; :mod:`digenrl.engine.runtime` runs what it is handed and imports neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from digenrl.config import RunConfig
from digenrl.errors import UserError
from digenrl.layout import RunLayout


def run_engine(
    cfg: RunConfig,
    run_dir: Path | None = None,
    on_iteration: Callable[[dict], None] | None = None,
    ray_address: str | None = None,
    resume: Path | None = None,
    layout: RunLayout | None = None,
):
    """Train ``cfg`` on Ray with placement ``cfg.placement.mode`` (colocated | disaggregated), as
    its ``layout`` (default: resolved here) says; see :func:`digenrl.engine.runtime.run_on_ray`.

    ``resume`` (a run or checkpoint directory) starts every worker from the latest complete
    checkpoint. Returns the :class:`~digenrl.runpolicy.RunResult`."""
    from digenrl.checkpoint import find_checkpoint, read_state
    from digenrl.engine.runtime import run_on_ray
    from digenrl.preflight import check_workers_build
    from digenrl.progress import progress
    from digenrl.resolve import resolve

    if cfg.placement.mode == "local":
        raise UserError("placement.mode: 'local' runs without the engine (use LocalTrainer)")
    resumed = read_state(find_checkpoint(resume)) if resume is not None else None
    start = resumed.iteration if resumed is not None else 0
    if start > cfg.train.iterations:
        raise UserError(
            f"--resume: the checkpoint has {start} iterations done, more than train.iterations "
            f"({cfg.train.iterations})"
        )
    layout = layout or resolve(cfg)
    progress("checking prompts, reward and model...")
    check_workers_build(cfg, layout, resumed)
    return run_on_ray(cfg, layout, resumed, run_dir, on_iteration, ray_address)
