"""HSDP in the engine (``train.fsdp: 2`` over 4 trainer ranks): two shard groups of 2 ranks, each one
scheduler worker training its own units, the gradient shards summed over the groups at the step.
On-policy, the run equals the single-process trainer; one group writes the sharded checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.checkpoint.load import read_state  # noqa: E402
from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from tests.helpers import TINY  # noqa: E402

pytestmark = pytest.mark.slow

BASE = [
    *TINY,
    "train.iterations=2",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
]
HSDP = [
    "placement.mode=disaggregated",
    "engine.tag=false",
    "engine.gap=true",
    "train.fsdp=2",
    "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 4}]",
]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


def test_hsdp_shard_groups_equal_the_local_trainer(cluster, tmp_path):
    ref = LocalTrainer(load_config(None, BASE)).run(tmp_path / "local")
    result = run_engine(load_config(None, BASE + HSDP), run_dir=tmp_path / "hsdp")
    want = load_file(tmp_path / "local" / "final" / "pytorch_lora_weights.safetensors")
    got = load_file(tmp_path / "hsdp" / "final" / "pytorch_lora_weights.safetensors")
    assert got.keys() == want.keys()
    for k in want:  # summed in another order (two reduce-scatters, then over the groups): as test_engine_fsdp
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    # the scheduler sees one worker per shard group: the groups' leads train, their followers never show
    tl = Timeline.from_chrome_trace(tmp_path / "hsdp" / "timeline.json")
    assert {t.worker for t in tl.of("train")} <= {"trainer0", "trainer2"}
    assert {t.worker for t in tl.of("step")} == {"trainer0", "trainer2"}
    # group 0 writes the optimizer shards (its 2 ranks hold every shard); nothing gathered
    state = read_state(tmp_path / "hsdp" / "checkpoints" / "iter-000002")
    assert state.optimizer_format == "dcp"
    assert sorted(n for n in state.files if n.startswith("dcp/__")) == [
        "dcp/__0_0.distcp",
        "dcp/__1_0.distcp",
    ]
