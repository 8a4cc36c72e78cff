"""A run without --ray-address starts its own Ray, even where `ray start` left a cluster address behind."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.slow

CHILD = """
import ray
from digenrl.engine.resources import start_local
assert start_local({"pool:rollout": 1}, num_cpus=1) is True
print("pools", ray.cluster_resources().get("pool:rollout"))
ray.shutdown()
"""


def test_start_local_ignores_the_address_ray_start_recorded():
    # `ray start` records its address in $RAY_TMPDIR/ray/ray_current_cluster; a plain ray.init() joins that
    # cluster (here: nobody listens) and then refuses num_cpus. Ours must start a fresh local one.
    tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    try:
        os.mkdir(f"{tmp}/ray")
        with open(f"{tmp}/ray/ray_current_cluster", "w") as f:
            f.write("127.0.0.1:9")
        env = {"RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled", "PATH": "/usr/bin:/bin"}
        out = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pools 1.0" in out.stdout
