"""Errors a user can cause. The CLI prints their message on one line and exits with code 2."""


class UserError(Exception):
    """Bad input: a config value, a missing file, an unsatisfiable cluster. Never a bug."""

    exit_code = 2


class RunStopped(UserError):
    """The run cannot go on (a trainer rank died, a worker used up its restarts); it stopped
    cleanly and the message says how to resume. Not bad input, so exit code 1."""

    exit_code = 1


class WeightSyncError(RuntimeError):
    """A weight transfer that would leave the receiver with different weights than the sender."""


class RunInterrupted(Exception):
    """Ctrl-C stopped a run cleanly (exit code 130); the message is the user's last line: what was
    kept and how to resume."""


#: resolved path -> where it came from, for a relative path a config file named (its folder is the base)
RELATIVE: dict[str, str] = {}


def relative_note(path) -> str:
    """`` (how a config's relative path became ``path``)`` for a "not found" line, or ""."""
    note = RELATIVE.get(str(path))
    return f" ({note})" if note else ""


def read_user_text(path, what: str) -> str:
    """The text of a file the user named, or a one-line UserError: missing, a directory, unreadable
    or not UTF-8 (``what``: the field or option that named it, e.g. ``prompts.file``)."""
    from pathlib import Path

    path = Path(path)
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{what}: {path} not found{relative_note(path)}") from None
    except IsADirectoryError:
        raise UserError(f"{what}: {path} is a directory, not a file") from None
    except OSError as exc:
        raise UserError(f"{what}: {path} cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{what}: {path} is not UTF-8 text (byte {exc.start})") from None


def actor_death(exc: BaseException) -> BaseException | None:
    """The Ray error saying an actor process died, when that is why ``exc`` failed (the worker's own,
    or one it called: a task error's ``cause``); else None."""
    import ray

    died = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)  # lost: its owner process died
    return next((e for e in (exc, getattr(exc, "cause", None)) if isinstance(e, died)), None)


def actor_died(exc: BaseException) -> bool:
    """The call failed because an actor process died (the worker's own, or one it called)."""
    return actor_death(exc) is not None


def first_line(exc: BaseException, typed: bool = False) -> str:
    """The first line of ``exc``'s message (``typed``: after its type's name, cut at 160 characters)."""
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text[0][:160]}" if typed else text[0]
