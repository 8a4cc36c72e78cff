"""Shared test helpers, and the suite's one tiny size."""

import atexit
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

#: The suite's tiny run: 16x16 images, 2 prompts x 4 samples, 4 sampling steps (the ``tiny_cfg``
#: fixture applies it; a test adds what it needs after it, and a later override wins).
TINY_IMAGE = ["model.height=16", "model.width=16"]  # the picture alone (a family's tiny preset may differ)
TINY = [
    *TINY_IMAGE,
    "train.prompts_per_iteration=2",
    "algorithm.group_size=4",
    "sampling.steps=4",
]
#: The engine's full mode: disaggregated, GAP + TSP 2 + TAG + one-step async (the default run before it
#: became colocated; configs/flux_tiny_disaggregated.yaml). A test of the overlapping engine that leaves
#: a knob to the defaults starts from this, so that the default run's mode does not change what it tests.
FULL_MODE = [
    "placement.mode=disaggregated",
    "engine.gap=true",
    "engine.tag=true",
    "engine.tsp_degree=2",
    "engine.max_staleness=1",
]


def as_sets(overrides: list[str]) -> list[str]:
    """Overrides as `digenrl` command-line options (``--set k=v`` each), for the CLI tests."""
    return [arg for kv in overrides for arg in ("--set", kv)]


FULL_MODE_SETS = as_sets(FULL_MODE)
TINY_SETS = as_sets(TINY)
#: No sample grids, no TensorBoard: what a run writes besides what a test reads.
QUIET = ["output.save_samples_every=0", "output.tensorboard=false"]
#: The logical devices of the suite's one Ray cluster: enough for every engine test's pools, and
#: rollout devices to spare, so the warm pool (tests/warm.py) keeps rollout actors of several kinds
#: (restart budget, scoring group) while a run uses others.
POOLS = {"pool:rollout": 4, "pool:trainer": 4}


def process_marker() -> str:
    """A fresh environment variable name for a subprocess: every process it starts (the Ray head,
    raylet, workers) inherits it, so :func:`marked` finds any survivor through /proc."""
    return f"DIGENRL_HYGIENE_{uuid.uuid4().hex}"


def marked(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker`` (Linux /proc)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                status = (proc / "status").read_text()
                if "\nState:\tZ" not in status:  # a zombie holds no resources (and is not ours to reap)
                    pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def still_running(proc) -> None:
    """Fail with what ``proc`` (a ``digenrl train`` subprocess) printed if it has ended already; a
    process it left behind may hold its pipes open, so its output is read for 20 s at most."""
    if proc.poll() is None:
        return
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        err = "(its stderr is still held open by a process it started)"
    pytest.fail(f"the run ended early with exit code {proc.returncode}: {err[-3000:]}")


def wait_gone(marker: str, timeout: float = 30.0) -> list[int]:
    """The processes carrying ``marker`` still alive after up to ``timeout`` seconds ([] once gone)."""
    deadline = time.time() + timeout
    while (left := marked(marker)) and time.time() < deadline:
        time.sleep(0.5)
    return left


def cli(monkeypatch, capsys, *argv):
    """Run the ``digenrl`` console entry point in-process: returns (exit code, stdout, stderr)."""
    from digenrl.cli.app import main

    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def ray_tmpdir(prefix: str) -> str:
    """A fresh directory for a subprocess's own Ray cluster (``RAY_TMPDIR``): short, under /tmp
    (Ray's socket paths must fit 107 bytes), removed when this test process exits."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    atexit.register(shutil.rmtree, path, True)
    return path


def local_ray(pools: dict[str, int] = POOLS):
    """A 2-CPU Ray cluster in this process with the logical devices ``pools`` (names of the default
    config's pools); a generator for fixtures: ``yield from local_ray()``. The suite starts one, for
    the whole session (conftest's ``ray_cluster``)."""
    import ray

    # log_to_driver off: what actors print stays in Ray's session logs -- forwarded, a late line landed
    # in the stderr of whichever CLI test was capturing next (seen under xdist: test_bad_input)
    quiet = dict(include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    ray.init(address="local", num_cpus=2, resources=dict(pools), **quiet)
    # Its log monitor tails every worker's log file for a driver that reads none (log_to_driver off):
    # ~10 s of CPU over a suite run, for nothing
    ray._private.worker._global_node.kill_log_monitor()
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark_here(name: str, tmp_path: Path, *args: str) -> dict:
    """``python benchmarks/<name> ARGS --json F``, run as its ``__main__`` in this process (from
    ``tmp_path``), and the JSON it wrote. Under the suite's Ray cluster (the caller asks for
    ``ray_cluster``) a benchmark uses that cluster instead of starting one
    (:func:`digenrl.engine.resources.start_local`), and its engine runs keep warm workers: seconds,
    where a process of its own starts Ray and every actor afresh."""
    out = tmp_path / f"{name}.json"
    saved = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [str(BENCH / name), *args, "--json", str(out)]
    sys.path.insert(0, str(BENCH))  # as `python benchmarks/X.py` puts the script's folder first
    os.chdir(tmp_path)
    try:
        runpy.run_path(str(BENCH / name), run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (None, 0), f"benchmarks/{name} exited with {exc.code}"
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.chdir(saved[2])
    return json.loads(out.read_text())


def assert_timeline_invariants(cfg, tl) -> None:
    """The invariants of docs/architecture.md on a run's timeline (as tests/test_engine.py checks them
    per mode): every part of every group generated once, by one version within the staleness bound;
    trained exactly once per TSP rank and mini-batch from samples of one version; one step per
    scheduled trainer (a group's lead) per mini-batch, the last of an iteration publishing."""
    from collections import Counter

    e, iters, n_groups, G = (
        cfg.engine,
        cfg.train.iterations,
        cfg.train.prompts_per_iteration,
        cfg.algorithm.group_size,
    )
    parts = G // (e.unit_samples or G)
    rollouts, trains, steps = tl.of("rollout"), tl.of("train"), tl.of("step")
    assert Counter((r.iteration, g) for r in rollouts for g in r.args["groups"]) == Counter(
        {(k, g): parts for k in range(iters) for g in range(n_groups)}
    )
    assert all(r.iteration - e.max_staleness <= r.version <= r.iteration for r in rollouts)
    S = cfg.train.optimizer_steps
    assert Counter(
        (t.iteration, g, t.args["tsp_rank"], t.args["minibatch"]) for t in trains for g in t.args["groups"]
    ) == Counter(
        {
            (k, g, r, s): parts
            for k in range(iters)
            for g in range(n_groups)
            for r in range(e.tsp_degree)
            for s in range(S)
        }
    )
    made_by = {(r.iteration, tuple(r.args["groups"])): r.version for r in rollouts}
    for t in trains:
        assert len(t.sample_versions) == 1 and t.version == t.iteration
        assert 0 <= t.version - t.sample_versions[0] <= e.max_staleness
        assert made_by[(t.iteration, tuple(t.args["groups"]))] == t.sample_versions[0]
    colocated = cfg.placement.mode == "colocated"
    leads = {w for w, pool in tl.workers.items() if (colocated or pool == "trainer") and tl.lead_of(w) == w}
    assert Counter(s.iteration for s in steps) == Counter({k: len(leads) * S for k in range(iters)})
    assert Counter(s.iteration for s in steps if "publishes" in s.args) == Counter(
        {k: len(leads) for k in range(iters)}
    )


from digenrl.data.edit_set import EDIT_COLOURS, write_edit_set  # noqa: E402,F401  (re-exported: the project's own)
