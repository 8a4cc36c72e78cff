"""The ``ocr`` reward in disaggregated engine runs: scored on the rollout workers, and in the reward
service; both finish. And what the OCR model costs a Ray worker process: its threads and memory."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
pytest.importorskip("rapidocr_onnxruntime", reason="the ocr extra (./dev.sh installs it)")

from digenrl.config.run import load_config  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from digenrl.run.rundir import read_metrics  # noqa: E402
from tests.helpers import TINY  # noqa: E402

OCR = "reward.components=[{name: ocr}]"
BASE = [
    *TINY,
    "train.iterations=2",
    "placement.mode=disaggregated",
    "engine.gap=true",
    "engine.tag=false",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
    "output.save_samples_every=0",
    "output.tensorboard=false",
]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("ocr-prompts") / "train.txt"
    path.write_text('a sign that says "Open"\na poster reading "Fresh Bread"\n')
    return f"prompts.file={path}"


@pytest.mark.slow
@pytest.mark.parametrize("service", [False, True], ids=["rollout_workers", "reward_service"])
def test_an_ocr_run_finishes_scored_where_configured(ray_cluster, prompts, tmp_path, service):
    from digenrl.rewards import scored_after_unit

    extra = ["reward.service={num_cpus: 0.1}"] if service else []
    cfg = load_config(None, [*BASE, OCR, prompts, *extra])
    assert scored_after_unit(cfg) is not service  # a model reward: after the unit on a rollout worker
    result = run_engine(cfg, run_dir=tmp_path)
    rows = read_metrics(tmp_path)
    assert len(result.metrics) == len(rows) == 2
    for row in rows:  # a 16-px image of noise spells nothing: 0, but scored
        assert 0.0 <= row["reward/ocr"] <= 1.0 and row["reward_latency_s/ocr"] > 0
        assert row["adv/ocr"] >= 0 and 0 <= row["adv_groups/ocr"] <= 1  # per-component advantage stats


@pytest.mark.slow
def test_the_ocr_model_in_a_ray_worker_holds_one_thread_per_session(ray_cluster):
    """Built in a Ray actor as the reward service builds it: the process gains at most the threads of
    ONNX Runtime's sessions at one thread each, and a bounded resident size (docs/configs.md)."""
    import ray

    @ray.remote(num_cpus=0.1)
    class Probe:
        def measure(self, threads):
            from benchmarks.ocr_reward import process_threads_rss, text_image
            from digenrl.config.train import RewardConfig
            from digenrl.rewards import build_reward

            before = process_threads_rss()
            reward = build_reward(RewardConfig(components=[{"name": "ocr", "args": {"threads": threads}}]))
            scores = [
                reward(text_image(side, text)[None], [f'"{text}"'])[1]["ocr"].item()
                for side, text in ((256, "Fresh Bread"), (512, "Open Late"))
            ]
            return before, process_threads_rss(), scores

    probe = Probe.options(runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}}).remote()
    try:
        (t0, rss0), (t1, rss1), scores = ray.get(probe.measure.remote(1), timeout=300)
    finally:
        ray.kill(probe)
    assert scores == [1.0, 1.0]
    assert t1 - t0 <= 3, (t0, t1)  # ONNX Runtime's pools at 1 thread add no worker threads
    assert 0 < rss1 - rss0 < 400, (rss0, rss1)  # MiB: the ~15 MB of models and their buffers
    print(f"ocr in a Ray worker: threads {t0} -> {t1}, RSS {rss0:.0f} -> {rss1:.0f} MiB")
