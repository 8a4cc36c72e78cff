"""Shared test helpers, and the suite's one tiny size."""

import sys

import pytest

#: The suite's tiny run: 16x16 images, 2 prompts x 4 samples, 4 sampling steps (the ``tiny_cfg``
#: fixture applies it; a test adds what it needs after it, and a later override wins).
TINY = [
    "model.height=16",
    "model.width=16",
    "train.prompts_per_iteration=2",
    "algorithm.group_size=4",
    "sampling.steps=4",
]
#: No sample grids, no TensorBoard: what a run writes besides what a test reads.
QUIET = ["output.save_samples_every=0", "output.tensorboard=false"]
#: The logical devices of the suite's one Ray cluster: enough for every engine test's pools.
POOLS = {"pool:rollout": 2, "pool:trainer": 4}


def cli(monkeypatch, capsys, *argv):
    """Run the ``digenrl`` console entry point in-process: returns (exit code, stdout, stderr)."""
    from digenrl.cli.app import main

    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def local_ray(pools: dict[str, int] = POOLS):
    """A 2-CPU Ray cluster in this process with the logical devices ``pools`` (names of the default
    config's pools); a generator for fixtures: ``yield from local_ray()``. The suite starts one, for
    the whole session (conftest's ``ray_cluster``)."""
    import ray

    ray.init(num_cpus=2, resources=dict(pools), include_dashboard=False, logging_level="WARNING")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
