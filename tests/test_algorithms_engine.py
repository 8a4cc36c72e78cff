"""AWM, Flow-DPPO, GRPO-Guard and online DPO on the Ray engine, 2 iterations each: the engine's full
mode (disaggregated, GAP + TSP 2 + TAG + one-step async, LoRA), colocated, and FSDP x2 with a full
fine-tune,
with the timeline invariants of docs/architecture.md; and on-policy FSDP x2 (LoRA) equal to the
single-process trainer. On the suite's one Ray cluster (conftest)."""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from tests.helpers import FULL_MODE, QUIET, TINY, assert_timeline_invariants  # noqa: E402

pytestmark = pytest.mark.slow

NAMES = ["awm", "flow_dppo", "grpo_guard", "online_dpo"]
BASE = [*TINY, *QUIET, "train.iterations=2", "output.checkpoint_every=0"]
TWO_TRAINERS = [
    "placement.mode=disaggregated",
    "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
    "engine.tag=false",
    "engine.gap=false",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
    "train.fsdp=2",
]
MODES = {
    "full_mode_lora": FULL_MODE,
    "colocated_lora": ["placement.mode=colocated"],
    "fsdp2_full": [*TWO_TRAINERS, "model.lora=null"],
}
LORA = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_runs_two_iterations_on_the_engine(name, mode, cluster, tmp_path):
    cfg = load_config(None, [*BASE, f"algorithm.name={name}", *MODES[mode]])
    result = run_engine(cfg, run_dir=tmp_path)
    assert_timeline_invariants(cfg, Timeline.from_chrome_trace(tmp_path / "timeline.json"))
    assert len(result.metrics) == 2
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in result.metrics)


@pytest.mark.parametrize("name", ["awm", "grpo_guard"])
def test_on_policy_fsdp_equals_the_local_trainer(name, cluster, tmp_path):
    sets = [*BASE, f"algorithm.name={name}"]
    ref = LocalTrainer(load_config(None, [*sets, "placement.mode=local"])).run(tmp_path / "local")
    result = run_engine(load_config(None, [*sets, *TWO_TRAINERS]), run_dir=tmp_path / "fsdp")
    want, got = (load_file(tmp_path / d / "final" / LORA) for d in ("local", "fsdp"))
    assert got.keys() == want.keys()
    for k in got:  # the same summed gradient in another order (test_engine's tolerance)
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
