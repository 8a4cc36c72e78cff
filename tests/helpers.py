"""Shared test helpers."""

import sys

import pytest


def cli(monkeypatch, capsys, *argv):
    """Run the ``digenrl`` console entry point in-process: returns (exit code, stdout, stderr)."""
    from digenrl.cli.app import main

    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err
