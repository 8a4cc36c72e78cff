"""benchmarks/gpu_smoke.sh counts the GPUs this process may use (issue 36, item 13): nvidia-smi lists
every GPU of the machine, CUDA_VISIBLE_DEVICES narrows them (on 849bed7 the script counted nvidia-smi's
list alone, so a job given one GPU of three planned three-rank runs). A stand-in nvidia-smi lists three
GPUs; no part runs (``PARTS=none``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = "\n".join(
    [
        "#!/bin/bash",
        'if [ "$1" = "-L" ]; then',
        '  for i in 0 1 2; do echo "GPU $i: NVIDIA H200 (UUID: GPU-$i)"; done; exit 0',
        "fi",
        'echo "NVIDIA H200"',
        "",
    ]
)


def _smoke(tmp_path: Path, visible: str | None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(FAKE)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PARTS="none")
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    script = ROOT / "benchmarks" / "gpu_smoke.sh"
    return subprocess.run(
        ["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize(
    "visible,count", [(None, 3), ("1", 1), ("0,2", 2), ("2,-1,0", 1), ("", 0), ("-1", 0)]
)
def test_counts_the_gpus_cuda_visible_devices_leaves(tmp_path, visible, count):
    done = _smoke(tmp_path, visible)
    if count == 0:
        assert done.returncode == 1 and "no GPU visible" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    assert f"gpu_smoke: {count} cuda device(s) (H200)" in done.stdout
    one = "NCCL between ranks" in done.stdout and "NOT checked" in done.stdout
    assert one == (count == 1)  # one device says plainly what it cannot check


def test_every_part_runs_by_default_and_is_described():
    """Each ``part NAME`` the script runs is in its default PARTS, in order, and named in the header's
    list of parts (a new part -- ``calls``, issue 51 -- cannot be left out of a plain run or undocumented)."""
    import re

    text = (ROOT / "benchmarks" / "gpu_smoke.sh").read_text()
    header = text.split("set -uo pipefail")[0]
    run = re.findall(r"^part (\w+) ", text, flags=re.M)
    default = re.search(r"PARTS=\$\{PARTS:-([\w ]+)\}", text).group(1).split()
    assert "calls" in run and run.index("calls") < run.index("fold")  # the fold reads calls.json
    assert [p for p in default if p in run] == run and set(default) == set(run)
    assert [p for p in run if not re.search(rf"^# - (\w+ / )?{p}\b|/ {p}:", header, flags=re.M)] == []
