"""The run directory (DESIGN.md §6): resolved config, metrics.jsonl, final weights."""

from __future__ import annotations

import json
import time
from pathlib import Path

from digenrl.config import RunConfig
from digenrl.errors import UserError


def default_run_dir(cfg: RunConfig) -> Path:
    return Path("runs") / f"{cfg.output.name}-{time.strftime('%Y%m%d-%H%M%S')}"


class RunDir:
    def __init__(self, cfg: RunConfig, path: Path | None = None):
        self.path = Path(path or cfg.output.run_dir or default_run_dir(cfg))
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise UserError(f"output.run_dir: {self.path} is not writable ({exc.strerror})") from None
        (self.path / "config.yaml").write_text(cfg.dump_yaml())
        self._metrics = open(self.path / "metrics.jsonl", "a")

    def log(self, row: dict) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        self._metrics.close()


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
