"""Library output (Ray, torch, diffusers warnings) of a command other than ``train`` goes to a log
file beside what the command writes, not to the terminal (``train`` keeps it in ``RUN/log.txt``)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console


@contextlib.contextmanager
def library_output_beside(
    console: Console, target: Callable[[], Path | None], stderr: bool = False
) -> Iterator[None]:
    """Route library output to a temporary log while the block runs; then append it to ``target()``
    (a file path, decided once the command knows where it writes) and say where it went (on stderr
    with ``stderr``: stdout carries JSON). Nothing is said or kept when the libraries printed nothing."""
    from digenrl.run.rundir import library_output_to_log

    log = None
    try:
        with library_output_to_log(console, enabled=True) as log:
            yield
    finally:
        if log is not None:
            _keep(Path(log), target(), console, stderr)


def _keep(log: Path, target: Path | None, console: Console, stderr: bool) -> None:
    text = log.read_text(errors="replace") if log.is_file() else ""
    if not text.strip():
        log.unlink(missing_ok=True)
        return
    if target is not None and target.parent.is_dir():
        with open(target, "a") as out:
            out.write(text)
        log.unlink(missing_ok=True)
    else:  # nowhere of the command's own: the temporary file stays
        target = log
    note = f"library messages (Ray, torch): {target}"
    if stderr:
        print(note, file=sys.stderr)
    else:
        console.print(note, soft_wrap=True, highlight=False)
