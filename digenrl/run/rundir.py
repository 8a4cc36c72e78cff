"""The run directory (docs/architecture.md): resolved config, metrics.jsonl, TensorBoard events, optional W&B.

``metrics.jsonl`` is the machine-readable record (one JSON object per iteration). Every numeric
key of a row also goes to TensorBoard (``tensorboard/``, when ``output.tensorboard``) and to
Weights & Biases (when ``output.wandb`` and the ``wandb`` package is importable), at step
``row["iteration"]``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from digenrl.config.run import RunConfig
from digenrl.errors import UserError
from digenrl.run.lock import run_entries


def default_run_dir(cfg: RunConfig) -> Path:
    return Path("runs") / f"{cfg.output.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_writable(path: Path, what: str) -> None:
    """Raise a one-line UserError unless ``path`` (or the nearest existing folder above it) is writable."""
    path = Path(path)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UserError(f"{what}: {path} is not writable ({probe} is a file, not a directory)")
    try:  # create nothing that stays: a probe file in the nearest existing folder
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UserError(f"{what}: {path} is not writable ({exc.strerror or exc} in {probe})") from None


def check_output_file(path: Path, what: str) -> None:
    """An output file the command will write at the end: refused now (one line) if it is a directory
    or cannot be written, so that no long run's result is lost to a bad path."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what}: {path} is a directory; name a file")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UserError(f"{what}: {path} is not writable")
        return
    check_writable(path.parent, what)


#: files that mark a directory as a DigenRL run (what --overwrite may delete)
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints", "log.txt")


def check_new_run_dir(path: Path, overwrite: bool = False) -> None:
    """Refuse (one line, nothing touched) a run directory that already holds something: a run is never
    overwritten unless ``overwrite``, and then only a directory that is a run. Call before any work."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"--run-dir: {path} is a file, not a directory")

    if not path.is_dir() or not run_entries(path):  # RUN/.lock is this run's own
        check_writable(path, "--run-dir")
        return
    if not overwrite:
        raise UserError(
            f"--run-dir: {path} already holds a run; continue it with --resume {path}, "
            "choose a new --run-dir, or pass --overwrite to replace it"
        )
    if not any((path / m).exists() for m in RUN_MARKERS):
        raise UserError(
            f"--overwrite: {path} is not a run directory (none of {', '.join(RUN_MARKERS)}); "
            "refusing to delete it"
        )
    check_writable(path, "--run-dir")


@contextlib.contextmanager
def library_output_to_log(terminal_console, enabled: bool = True):
    """Route what libraries print (Ray's raylet / worker lines, torch warnings, C-level output of child
    processes) to a log file while the driver runs; ``terminal_console`` keeps writing to the terminal.
    Yields the log's temporary path; :func:`keep_log` moves it into the run directory. Only when this
    process's stdout / stderr are the real ones (not under a test's capture) and ``enabled``."""
    real = sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__
    if not enabled or not real:
        yield None
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    _TERMINAL["stderr"] = saved[1]
    fd, log_path = tempfile.mkstemp(prefix="digenrl-log-", suffix=".txt")
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    old_file = terminal_console.file
    log = os.fdopen(fd, "w", buffering=1)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout, sys.stderr = log, log
    terminal_console.file = terminal
    try:
        yield Path(log_path)
    finally:
        log.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        _TERMINAL.pop("stderr", None)
        for f in saved:
            os.close(f)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        terminal_console.file = old_file
        log.flush()  # left open: a library's logging handler may still hold it and write at exit


_TERMINAL: dict[str, int] = {}  # the terminal's stderr while library output goes to the log


def terminal_stderr() -> int:
    """The file descriptor of the terminal's stderr (fd 2, unless :func:`library_output_to_log`
    routes fd 2 to its log): where a line for the user goes from a thread."""
    return _TERMINAL.get("stderr", 2)


def keep_log(log_path: Path | None, run_dir: Path | None) -> Path | None:
    """Append the routed library output to ``RUN/log.txt`` (when the run directory exists); drop it
    otherwise."""
    if log_path is None:
        return None
    try:
        if run_dir is not None and Path(run_dir).is_dir():
            with open(Path(run_dir) / "log.txt", "a") as out:
                out.write(Path(log_path).read_text(errors="replace"))
            return Path(run_dir) / "log.txt"
        return None
    finally:
        Path(log_path).unlink(missing_ok=True)


def numeric_items(row: dict):
    """(key, float) for every number of a metrics row except the step counter itself."""
    for k, v in row.items():
        if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            yield k, float(v)


class RunDir:
    """Opens (or reopens) a run directory for writing.

    ``history``: on resume, the rows of the iterations before the checkpoint; ``metrics.jsonl`` is
    rewritten to exactly those (dropping rows logged after the checkpoint by the interrupted run)
    and new rows are appended. TensorBoard drops its events from that step on as well.
    """

    def __init__(self, cfg: RunConfig, path: Path | None = None, history: list[dict] | None = None):
        self.path = Path(path or cfg.output.run_dir or default_run_dir(cfg))
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise UserError(f"output.run_dir: {self.path} is not writable ({exc.strerror})") from None
        (self.path / "config.yaml").write_text(cfg.dump_yaml())
        metrics = self.path / "metrics.jsonl"
        start = None
        if history is not None:
            tmp = metrics.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in history))
            os.replace(tmp, metrics)
            start = history[-1]["iteration"] + 1 if history else 0
        self._metrics = open(metrics, "a")
        self._tb = self._open_tensorboard(start) if cfg.output.tensorboard else None
        self._wandb = self._open_wandb(cfg) if cfg.output.wandb else None

    def _open_tensorboard(self, purge_step: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print(
                "warning: output.tensorboard is on but the tensorboard package is not installed "
                "(pip install tensorboard); logging to metrics.jsonl only",
                file=sys.stderr,
            )
            return None
        return SummaryWriter(str(self.path / "tensorboard"), purge_step=purge_step, flush_secs=10)

    def _open_wandb(self, cfg: RunConfig):
        try:
            import wandb
        except ImportError:
            print(
                "warning: output.wandb is on but the wandb package is not installed; skipping W&B",
                file=sys.stderr,
            )
            return None
        id_file = self.path / "wandb-id"  # the same W&B run across resumes
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        return wandb.init(
            project="digenrl",
            name=self.path.name,
            id=run_id,
            resume="allow",
            dir=str(self.path),
            config=cfg.model_dump(mode="json"),
        )

    def log(self, row: dict) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        step = int(row.get("iteration", 0))
        if self._tb is not None:
            for k, v in numeric_items(row):
                self._tb.add_scalar(k, v, global_step=step)
        if self._wandb is not None:
            self._wandb.log(dict(numeric_items(row)), step=step)

    def log_image(self, path: Path, step: int, tag: str = "samples") -> None:
        """A saved sample grid (``samples/iter-*.png``; a video's ``.gif``: its first frame to TensorBoard,
        the animation to W&B) logged at ``step``, as flow_grpo logs its samples."""
        if self._tb is None and self._wandb is None:
            return
        import numpy as np
        from PIL import Image

        with Image.open(path) as img:
            frame = np.asarray(img.convert("RGB"))
        if self._tb is not None:
            self._tb.add_image(tag, frame, global_step=step, dataformats="HWC")
        if self._wandb is not None:
            import wandb

            media = wandb.Video(str(path)) if Path(path).suffix == ".gif" else wandb.Image(str(path))
            self._wandb.log({tag: media}, step=step)

    def close(self) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
