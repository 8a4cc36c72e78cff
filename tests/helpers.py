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


def local_ray(rollout: int = 1, trainer: int = 1):
    """A 2-CPU Ray cluster in this process with ``rollout`` + ``trainer`` logical devices (the pools
    of the default config); a generator for module-scoped fixtures: ``yield from local_ray()``."""
    import ray

    ray.init(
        num_cpus=2,
        resources={"pool:rollout": rollout, "pool:trainer": trainer},
        include_dashboard=False,
        logging_level="WARNING",
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
