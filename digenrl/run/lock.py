"""One run per directory: ``RUN/.lock``, held (``fcntl.flock``) by the ``digenrl train`` that writes RUN.

Details: docs/modules.md, `digenrl.run.lock`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from digenrl.errors import UserError

LOCK_FILE = ".lock"
REPLACED_DIR = ".replaced"
#: entries of a run directory that are the lock's, not the run's
HIDDEN = (LOCK_FILE, REPLACED_DIR)


class RunLock:
    """Holds ``RUN/.lock`` while a run writes RUN. ``created``: the folders the claim made (RUN and
    any missing parents, e.g. ``runs/``), innermost first: a claim that ends with nothing written
    removes them again."""

    def __init__(self, path: Path, fd: int, created: list[Path]):
        self.path, self._fd, self.created = Path(path), fd, created

    def unlock(self) -> None:
        """Give the directory back: drop the lock file (first, while still holding it) and the folders
        the claim created, where nothing else was written into them."""
        if self._fd is None:
            return
        try:
            (self.path / LOCK_FILE).unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None
        _remove_empty(self.created)  # only if empty: a run that wrote something keeps it

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.unlock()


def _owner_text() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"


def claim_run_dir(path: Path, what: str = "--run-dir") -> RunLock:
    """Take RUN (created if missing) for this process, or raise a one-line UserError naming the live
    owner. A stale lock (its owner died) is taken over with a note on stderr."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{what}: {path} is a file, not a directory")
    created = _missing_folders(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_empty(created)
        raise UserError(f"{what}: {path} is not writable ({exc.strerror or exc})") from None
    lock = path / LOCK_FILE
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            _remove_empty(created)
            raise UserError(f"{what}: {path} is not writable ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _read(fd)
            os.close(fd)
            raise UserError(
                f"{what}: {path} is in use by another digenrl train ({owner or 'owner unknown'}); "
                "wait for it to finish, or choose another --run-dir"
            ) from None
        try:  # the file we locked may have been removed by its owner meanwhile: lock the current one
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    stale = _read(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, _owner_text().encode(), 0)
    claim = RunLock(path, fd, created)
    if stale:
        print(
            f"note: {path} was locked by a run that is no longer running ({stale}); taking it over",
            file=sys.stderr,
        )
    if (path / REPLACED_DIR).is_dir():  # a killed --overwrite: keep whichever run is safe
        ReplacedRun(path).finish()
    return claim


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, innermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def run_entries(path: Path) -> list[Path]:
    """What RUN holds besides the lock's own files."""
    return [p for p in Path(path).iterdir() if p.name not in HIDDEN]


class ReplacedRun:
    """``--overwrite``: the old run's files set aside in ``RUN/.replaced/`` while the new run starts."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.aside = self.path / REPLACED_DIR
        self.done = False

    def set_aside(self) -> None:
        self.aside.mkdir(exist_ok=True)
        for entry in run_entries(self.path):
            os.replace(entry, self.aside / entry.name)

    def new_run_is_safe(self) -> bool:
        from digenrl.checkpoint.store import latest_checkpoint

        return latest_checkpoint(self.path) is not None

    def commit_if_safe(self) -> bool:
        """Delete the old run once RUN holds a complete checkpoint of the new one."""
        if not self.done and self.aside.is_dir() and self.new_run_is_safe():
            shutil.rmtree(self.aside)
            self.done = True
        return self.done

    def drop(self) -> None:
        """The new run finished: delete the old run."""
        if not self.done and self.aside.is_dir():
            shutil.rmtree(self.aside)
        self.done = True

    def finish(self) -> bool:
        """The new run ended (or was killed). True when the old run was restored because the new one
        wrote no checkpoint (its files are removed); else the old run is deleted."""
        if self.done or not self.aside.is_dir():
            return False
        if self.commit_if_safe():
            return False
        for entry in run_entries(self.path):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for entry in list(self.aside.iterdir()):
            os.replace(entry, self.path / entry.name)
        self.aside.rmdir()
        self.done = True
        return True
