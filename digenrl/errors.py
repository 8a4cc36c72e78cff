"""Errors a user can cause. The CLI prints their message on one line and exits with code 2."""


class UserError(Exception):
    """Bad input: a config value, a missing file, an unsatisfiable cluster. Never a bug."""

    exit_code = 2


class RunStopped(UserError):
    """The run cannot go on (a trainer rank died, a worker used up its restarts); it stopped
    cleanly and the message says how to resume. Not bad input, so exit code 1."""

    exit_code = 1
