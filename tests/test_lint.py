"""The tree stays lint clean and formatted: ``ruff check`` and ``ruff format --check`` (the rules and
line length of pyproject.toml) over the whole repository. Skipped only where ruff is not installed
(it is a dev dependency, so CI has it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff() -> str | None:
    beside = Path(sys.executable).with_name("ruff")  # the virtual environment's own
    return str(beside) if beside.is_file() else shutil.which("ruff")


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_finds_nothing(command):
    exe = ruff()
    assert exe, "ruff is not installed: it is a dev dependency (pip install -e '.[dev]')"
    done = subprocess.run([exe, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
