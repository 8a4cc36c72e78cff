"""Errors a user can cause. The CLI prints their message on one line and exits with code 2."""


class UserError(Exception):
    """Bad input: a config value, a missing file, an unsatisfiable cluster. Never a bug."""

    exit_code = 2
