"""Resource hygiene: `digenrl train` on the engine leaves no process behind, whether it
ends normally or is interrupted with Ctrl-C, and an interrupted run leaves nothing half-written.

Each run is a real subprocess with a marker in its environment; every process it starts (the Ray
head, raylet, workers) inherits the marker, so any survivor is found through /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import TINY

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)"),
]

SMALL = [
    *TINY,
    "output.save_samples_every=0",
    "output.checkpoint_every=1",
]


def marked(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker``."""
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


def start_train(run_dir: Path, iterations: int) -> tuple[subprocess.Popen, str]:
    marker = f"DIGENRL_HYGIENE_{uuid.uuid4().hex}"
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        marker: "1",
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="dh", dir="/tmp"),
    }  # short: Ray's socket paths are limited
    argv = [
        sys.executable,
        "-m",
        "digenrl.cli.app",
        "train",
        "--run-dir",
        str(run_dir),
        "--set",
        f"train.iterations={iterations}",
        *sum((["--set", s] for s in SMALL), []),
    ]
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
    return proc, marker


def wait_gone(marker: str, timeout: float = 30.0) -> list[int]:
    deadline = time.time() + timeout
    while (left := marked(marker)) and time.time() < deadline:
        time.sleep(0.5)
    return left


def test_normal_exit_leaves_no_process(tmp_path):
    """... and the terminal gets only DigenRL's own lines: what Ray / torch print goes to RUN/log.txt."""
    proc, marker = start_train(tmp_path / "run", iterations=2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert wait_gone(marker) == []
    lines = out.splitlines()
    assert lines[0] == "digenrl train: loading the config..."  # the first thing the user sees
    assert lines[-1].startswith(f"run directory: {tmp_path / 'run'}")
    assert err == "" and "\x1b[" not in out
    assert not any(noise in out for noise in ("raylet", "core_worker", "(EngineWorker", "Warning"))
    assert (tmp_path / "run" / "log.txt").is_file()


def test_ctrl_c_stops_the_actors_and_writes_nothing_partial(tmp_path):
    run = tmp_path / "run"
    proc, marker = start_train(run, iterations=2000)  # cannot finish on its own within the test
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:  # interrupt once training is under way
        if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1]
    assert len(marked(marker)) > 1  # the driver and the Ray processes it started
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the driver
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]  # what was kept and how to resume (tests/test_interrupt.py)
    assert last.startswith("interrupted with ") and last.endswith(
        f"resume with: digenrl train --resume {run}"
    )
    assert "Traceback" not in err
    assert wait_gone(marker) == []
    # nothing half-written: whole metrics rows, only complete checkpoints, the config
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(len(rows)))
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert all((c / "state.json").is_file() for c in (run / "checkpoints").iterdir())
    assert (run / "config.yaml").is_file()


def test_killed_ray_head_stops_the_run_within_seconds(tmp_path):
    """The driver joined a cluster (--ray-address) whose head dies mid-run: one line saying so and
    how to resume, exit 1, within seconds (Ray alone would hang a minute, then end the process)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head_dir = tempfile.mkdtemp(prefix="dk", dir="/tmp")
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    subprocess.run(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            '--resources={"pool:rollout": 1, "pool:trainer": 1}',
            f"--temp-dir={head_dir}",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    run = tmp_path / "run"
    try:
        argv = [
            sys.executable,
            "-m",
            "digenrl.cli.app",
            "train",
            "--run-dir",
            str(run),
            "--ray-address",
            f"127.0.0.1:{port}",
            "--set",
            "train.iterations=500",
            *sum((["--set", s] for s in SMALL), []),
        ]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1]
        subprocess.run(
            ["pkill", "-9", "-f", f"(gcs_server|raylet).*{head_dir}"], check=False
        )  # the head dies
        killed = time.time()
        _, err = proc.communicate(timeout=60)
        assert time.time() - killed < 20
        assert proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: the Ray cluster's head at ") and ":" + str(port) in last
        assert last.endswith(f"resume with: digenrl train --resume {run}")
    finally:
        subprocess.run(["pkill", "-9", "-f", head_dir], check=False)
