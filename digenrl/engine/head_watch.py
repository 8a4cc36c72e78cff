"""The driver's watch on the cluster's head (GCS) while a run holds the cluster: a thread that stops
the run within seconds when the head dies while the driver waits in a Ray call.

Details: docs/modules.md, `digenrl.engine.head_watch`.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import socket
import sys
import threading
import time

from digenrl.errors import RunStopped

PROBE_S = 1.0  # how often the watch asks whether the head accepts connections
GRACE_S = 4.0  # the driver's own probe (every 2 s, between Ray calls) reports a dead head first
LAST_S = 12.0  # a Ray call deaf to signals: the process ends with the run's line (Ray: ~60 s, no word)
SIGNAL = signal.SIGUSR1  # (simulated with interrupt_main, never sent): wakes the blocked main thread


def head_error(address: str, problem: str) -> str:
    """The run's one line when the cluster's head at ``address`` stopped answering."""
    return f"the Ray cluster's head at {address} stopped answering ({problem}); the run stopped."


def probe(address: str, timeout: float = 3.0) -> str | None:
    """Why ``host:port`` does not accept a connection, or None when it does."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return None
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)


class HeadWatch:
    """Probes the head every ``probe_s``. The driver reports a dead head itself (:func:`noticed`);
    when it has not after ``grace_s`` -- it waits in a Ray call, which Ray would let wait ~60 s for
    the GCS and then end the process without a word -- a Ray call that checks for signals
    (``ray.get``, ``ray.wait``) is interrupted (KeyboardInterrupt; :func:`watching_head` turns it
    into the run's error), and after ``last_s`` any other one ends the process: the run's line on
    the terminal (``explain`` adds how to resume), exit code 1."""

    def __init__(self, address: str, probe_s=PROBE_S, grace_s=GRACE_S, last_s=LAST_S, terminal_fd=2):
        self.address, self.probe_s, self.grace_s, self.last_s = address, probe_s, grace_s, last_s
        self.terminal_fd = terminal_fd  # where the last line goes (the terminal's stderr, not a log)
        self.explain = lambda exc: exc  # the run's error -> the error it ends with (how to resume)
        self.problem: str | None = None  # set when the watch wakes the driver: why the head is gone
        self.noticed = False  # the driver found the head gone itself: its own report follows
        self.woke = False  # a Ray call was interrupted: the run's end is on its way (once is enough)
        self.lock, self.done = threading.Lock(), threading.Event()
        self.installed, self.previous = False, None
        ray = sys.modules.get("ray")  # the calls to wake are Ray's: its code's folder
        self.ray_dir = os.path.dirname(ray.__file__) + os.sep if getattr(ray, "__file__", None) else None

    def start(self) -> HeadWatch:
        if threading.current_thread() is threading.main_thread():  # (elsewhere: the last resort only)
            self.previous, self.installed = signal.signal(SIGNAL, self._wake), True
        threading.Thread(target=self._run, name="digenrl-head-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        with self.lock:
            self.done.set()
        if self.installed:
            signal.signal(SIGNAL, self.previous)

    def error(self) -> RunStopped:
        return RunStopped(head_error(self.address, self.problem or "no answer"))

    def _run(self) -> None:
        down_since = None
        while not self.done.wait(self.probe_s):
            problem = probe(self.address)
            if problem is None:
                down_since = None
                continue
            down_since = down_since or time.monotonic()
            down = time.monotonic() - down_since
            with self.lock:
                if self.done.is_set() or self.noticed or down < self.grace_s:
                    continue
                self.problem = problem
                if down < self.last_s:
                    if self.installed and not self.woke:  # (each probe, until it is in a Ray call)
                        _thread.interrupt_main(SIGNAL)
                    continue
                self._end()

    def _wake(self, signum, frame) -> None:
        """In the main thread: raise where it waits in Ray's code (Ray returns the interrupt from
        its call), nowhere else (the driver's own code reaches its next Ray call or probe soon)."""
        if self.problem is not None and not self.noticed:
            in_ray = frame is not None and self.ray_dir and frame.f_code.co_filename.startswith(self.ray_dir)
            if in_ray and not self.woke:
                self.woke = True
                raise KeyboardInterrupt
        elif callable(self.previous):
            self.previous(signum, frame)

    def _end(self) -> None:
        exc = self.error()
        with contextlib.suppress(Exception):
            exc = self.explain(exc)
        with contextlib.suppress(OSError):
            os.write(self.terminal_fd, f"error: {exc}\n".encode())
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(getattr(exc, "exit_code", 1))


_current: HeadWatch | None = None  # the watch of the run this process drives


@contextlib.contextmanager
def watching_head(address: str, terminal_fd: int = 2, **timing):
    """Inside: the head at ``address`` is watched (:class:`HeadWatch`; ``timing``: its ``probe_s``,
    ``grace_s``, ``last_s``); a Ray call the watch interrupted ends as the run's error (RunStopped,
    exit code 1)."""
    global _current
    watch = HeadWatch(address, terminal_fd=terminal_fd, **timing).start()
    _current = watch
    try:
        yield watch
    except KeyboardInterrupt:
        if not watch.woke:  # Ctrl-C
            raise
        raise watch.error() from None
    finally:
        watch.stop()
        _current = None


def noticed() -> None:
    """The driver found the head gone itself (its own report follows): the watch stands down."""
    if _current is not None:
        with _current.lock:
            _current.noticed = True


def woke() -> bool:
    """Whether the watch interrupted the driver's Ray call (a KeyboardInterrupt that is no Ctrl-C)."""
    return _current is not None and _current.woke


def explain(how) -> None:
    """``how(exc)``: the error a run ends with on the watch's last resort (how to resume)."""
    if _current is not None:
        _current.explain = how
