"""Progress stages a user should see while nothing else moves (Ray starting, workers building).

A driver calls :func:`progress` at the start of each stage it controls, e.g.
``progress("starting 2 workers...")`` or ``progress("waiting for the first weights...")``; the CLI
shows the latest stage (and ``--quiet`` hides it). Without a listener (library use, tests) a call
does nothing, so drivers can call it unconditionally.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

_listeners: list[Callable[[str], None]] = []


def progress(stage: str) -> None:
    """Announce that the run entered ``stage`` (a short phrase ending in '...')."""
    for listener in list(_listeners):
        listener(stage)


@contextlib.contextmanager
def listening(listener: Callable[[str], None]) -> Iterator[None]:
    """Send every :func:`progress` stage to ``listener`` inside the ``with`` block."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
