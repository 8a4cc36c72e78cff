"""Ctrl-C keeps the work: `digenrl train` interrupted mid-run writes a checkpoint of the
last completed iteration, exits 130 with a last line that says how to resume, and `--resume`
continues from exactly there: every iteration's metrics row once, the interrupted run's rows as
they were. Each run is a real subprocess sent a real SIGINT, on the engine (its full mode and the
default colocated run) and on the local trainer.

The same runs show the resource hygiene of both ends: nothing half-written after Ctrl-C, no
process left behind after Ctrl-C or a normal exit (each run carries a marker in its environment,
inherited by every process it starts: the Ray head, raylet, workers; found through /proc), and a
normal exit prints only DigenRL's own lines (what Ray / torch print goes to RUN/log.txt).
tests/test_hygiene.py kills a cluster's head."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    FULL_MODE,
    TINY,
    as_sets,
    marked,
    process_marker,
    ray_tmpdir,
    still_running,
    wait_gone,
)

SMALL = [
    *TINY,
    "output.save_samples_every=0",
]


def train(*args: str) -> subprocess.Popen:
    """``digenrl train ARGS`` as a subprocess; ``proc.marker`` is in the environment of every process
    it starts (:func:`tests.helpers.marked`)."""
    marker = process_marker()
    ray_dir = ray_tmpdir("di")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_dir}
    env[marker] = "1"  # (RAY_TMPDIR short: Ray's socket paths are limited)
    argv = [sys.executable, "-m", "digenrl.cli.app", "train", *args]
    # SIGINT as a terminal delivers it: a suite started in the background (`cmd &` in a script) ignores
    # SIGINT, children inherit that, and Python then never raises KeyboardInterrupt -- Ctrl-C would be lost
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    proc.marker, proc.ray_sessions = marker, lambda: list(Path(ray_dir).glob("ray/session_*"))
    return proc


def rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def checkpoints(run: Path) -> list[int]:
    return sorted(
        int(json.loads((c / "state.json").read_text())["iteration"])
        for c in (run / "checkpoints").glob("iter-*")
    )


def interrupt_then_resume(run: Path, extra: list[str], resume: bool = True) -> None:
    sets = as_sets(SMALL + extra)
    proc = train("--run-dir", str(run), "--set", "train.iterations=1000", *sets)  # cannot finish in the test
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and len(rows(run)) < 2:
        time.sleep(0.3)
    still_running(proc)
    engine = "placement.mode=local" not in extra
    assert len(marked(proc.marker)) > (1 if engine else 0)  # the driver (and the Ray processes it started)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert wait_gone(proc.marker) == []  # every actor stopped, the local cluster shut down
    assert proc.ray_sessions() == []  # and its session directory removed (issue 56: they piled up)
    before = rows(run)
    done = len(before)
    assert 2 <= done < 20  # stopped well before the default periodic checkpoint (output.checkpoint_every: 20)
    assert [r["iteration"] for r in before] == list(range(done))  # whole rows, in order
    assert checkpoints(run) == [done]  # the checkpoint of the last completed iteration, written on Ctrl-C
    assert not list((run / "checkpoints").glob(".tmp-*"))  # nothing half-written
    assert (run / "config.yaml").is_file()
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert last == (
        f"interrupted with {done} of 1000 iterations done; last checkpoint: "
        f"{run / 'checkpoints' / f'iter-{done:06d}'} (iteration {done}); "
        f"resume with: digenrl train --resume {run}"
    )

    if not resume:
        return
    proc = train("--resume", str(run), "--set", f"train.iterations={done + 2}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert wait_gone(proc.marker) == []  # a normal exit leaves no process either
    assert proc.ray_sessions() == []  # nor Ray's session directory
    assert f"resuming from {run / 'checkpoints' / f'iter-{done:06d}'} (iteration {done} of {done + 2})" in out
    lines = out.splitlines()  # the terminal gets only DigenRL's own lines
    assert lines[0] == "digenrl train: loading the config..."  # the first thing the user sees
    assert lines[-1].startswith(f"run directory: {run}")
    assert err == "" and "\x1b[" not in out
    assert not any(noise in out for noise in ("raylet", "core_worker", "(EngineWorker", "Warning"))
    assert (run / "log.txt").is_file()
    after = rows(run)
    assert [r["iteration"] for r in after] == list(range(done + 2))  # each iteration exactly once
    assert after[:done] == before  # the interrupted run's rows are kept as they were
    assert (run / "final").is_dir()
    if (run / "timeline.json").is_file():  # the engine: one timeline of the whole run, not of its last part
        from collections import Counter

        from digenrl.engine.timeline import Timeline

        tl = Timeline.from_chrome_trace(run / "timeline.json")
        steps = Counter(e.iteration for e in tl.of("step") if "publishes" in e.args)
        assert sorted(steps) == list(range(done + 2)) and len(set(steps.values())) == 1, steps
        assert list(tl.iteration_spans()) == list(range(done + 2))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [FULL_MODE, []], ids=["full", "default_colocated"])
def test_ctrl_c_on_the_engine_keeps_the_last_iteration_and_resumes(mode, tmp_path):
    """The engine's full mode (tests.helpers.FULL_MODE): disaggregated, GAP + TSP + TAG + one-step
    async, so at the interrupt rank 0 may be mid-iteration with the next iteration's rollouts in flight;
    and the default run (colocated, on-policy), the one a user interrupts first. The resume runs on
    the default (the same resume path for every placement: ``launch.run_engine``)."""
    interrupt_then_resume(tmp_path / "run", mode, resume=not mode)


@pytest.mark.slow
def test_ctrl_c_on_the_local_trainer_keeps_the_last_iteration_and_resumes(tmp_path):
    interrupt_then_resume(tmp_path / "run", ["placement.mode=local"])


@pytest.mark.slow
@pytest.mark.faults
def test_a_fatal_error_mid_run_keeps_the_last_iteration(tmp_path, monkeypatch, capsys, ray_cluster):
    """The reward actor dies for good while scoring iteration 1 (engine.max_restarts: 0): rank 0's
    state is intact, so the run stops with a checkpoint of iteration 1 (none was due) and says so.
    (`digenrl train` in this process, on the suite's cluster.)"""
    from tests.helpers import cli

    run = tmp_path / "run"
    sets = SMALL + [
        *FULL_MODE,
        "train.iterations=3",
        "output.checkpoint_every=0",
        "engine.max_staleness=0",
        "engine.max_restarts=0",
        "reward.service={num_cpus: 0.1}",
        "engine.faults=[{worker: reward, unit: rollout-1-0}]",
    ]
    code, _, err = cli(monkeypatch, capsys, "train", "--run-dir", str(run), *as_sets(sets))
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the reward actor died and was not restarted (engine.max_restarts: 0")
    assert last.endswith(
        f"last checkpoint: {run / 'checkpoints' / 'iter-000001'} (iteration 1); "
        f"resume with: digenrl train --resume {run}"
    )
    assert [r["iteration"] for r in rows(run)] == [0] and checkpoints(run) == [1]


def test_first_ctrl_c_asks_a_second_stops_at_once():
    """The SIGINT handler both drivers install: the first press is a request (or abandons
    abandonable work), the second raises at once; the previous handler comes back afterwards."""
    from digenrl.run.cadence import stop_on_interrupt

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts us
    try:
        with stop_on_interrupt() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert stop.requested and not stop.forced
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
            assert stop.forced
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with stop_on_interrupt() as stop:
            with pytest.raises(KeyboardInterrupt), stop.abandonable():  # a first press abandons this work
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
            assert stop.requested and not stop.forced
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_checkpoint_kept_on_a_stop_is_the_last_logged_iteration(tmp_path):
    """Only when the trainer holds exactly the version after the last row, something was done and
    no checkpoint of it exists yet; the last line names the newest checkpoint on disk."""
    from digenrl.checkpoint.store import save_checkpoint
    from digenrl.config.run import load_config
    from digenrl.errors import RunInterrupted, RunStopped
    from digenrl.run.cadence import checkpoint_to_keep, stopped

    assert checkpoint_to_keep(tmp_path, 3, 3)
    assert not checkpoint_to_keep(tmp_path, 3, 4)  # rank 0 stepped past a row not written: cannot
    assert not checkpoint_to_keep(tmp_path, 0, 0)  # nothing done
    exc = stopped(KeyboardInterrupt(), tmp_path, 0, 10)
    assert isinstance(exc, RunInterrupted)
    assert (
        str(exc) == "interrupted with 0 of 10 iterations done; no checkpoint was written "
        "(0 of 10 iterations done, nothing to resume from)"
    )
    from digenrl.policy.model import Policy

    policy = Policy(load_config(None, SMALL))
    policy.version = 3
    save_checkpoint(tmp_path, policy, 3)
    assert not checkpoint_to_keep(tmp_path, 3, 3)  # already there
    exc = stopped(RunStopped("the reward actor died; the run stopped."), tmp_path, 3, 10)
    assert str(exc) == (
        f"the reward actor died; the run stopped; last checkpoint: "
        f"{tmp_path / 'checkpoints' / 'iter-000003'} (iteration 3); resume with: digenrl train --resume "
        f"{tmp_path}"
    )
