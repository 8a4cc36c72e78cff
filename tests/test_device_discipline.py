"""Device discipline (issue 36, item 2), with CUDA reported available on this CPU machine: an actor
that asks for no GPU sees none, and the driver's preflight never calls into CUDA (it does not load a
model reward: the workers that score dry-run it)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture
def cuda_reported(monkeypatch):
    """torch says 8 GPUs are there; initialising CUDA raises (what the driver must never do)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the driver initialised CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    monkeypatch.setattr(torch.cuda, "init", refuse)


@pytest.mark.slow
def test_the_driver_preflight_never_calls_into_cuda_for_a_model_reward(tiny_cfg, cuda_reported, tmp_path):
    """A disaggregated run with a model reward (CLIPScore, ``device: auto``) on a host whose GPUs torch
    sees: resolving the layout (CPU pools: every worker on ``cpu``) and the preflight of what the
    workers build run without initialising CUDA. On 849bed7 the preflight built the reward on the
    driver, which put it on ``cuda`` (a CUDA context on the head for the whole run)."""
    from digenrl.placement.preflight import check_workers_build
    from digenrl.placement.resolve import resolve
    from tests.test_model_rewards import make_tiny_clip

    clip = make_tiny_clip(tmp_path / "clip")
    cfg = tiny_cfg(
        "placement.mode=disaggregated",
        "engine.tag=false",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]",
        f"reward.components=[{{name: clipscore, args: {{path: {clip}}}}}]",
    )
    layout = resolve(cfg)
    assert {layout.worker(w.name).device for w in layout.workers} == {"cpu"}
    check_workers_build(cfg, layout)


def test_an_actor_that_asks_for_no_gpu_is_given_none():
    from digenrl.engine.cluster import device_env

    assert device_env(0) == {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    assert device_env(0.0) == device_env(0)
    assert device_env(1) is None and device_env(0.5) is None  # (Ray sets it for a GPU actor)


@pytest.mark.slow
def test_zero_gpu_actors_see_no_gpu_on_a_real_ray_cluster(ray_cluster, monkeypatch):
    """Started as the engine starts its workers (``num_gpus=0`` and :func:`device_env`), an actor's
    process has ``CUDA_VISIBLE_DEVICES`` set empty: torch there sees no GPU whatever the node has, so
    ``train.device: auto`` and a reward's ``device: auto`` mean the CPU. On 849bed7 it was unset."""
    import ray

    from digenrl.engine.cluster import device_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # (what the driver's own environment would pass on)

    @ray.remote(num_cpus=0)
    class Probe:
        def visible(self):
            return os.environ.get("CUDA_VISIBLE_DEVICES")

    probe = Probe.options(num_gpus=0, runtime_env=device_env(0)).remote()
    try:
        assert ray.get(probe.visible.remote()) == ""
    finally:
        ray.kill(probe)


@pytest.mark.slow
def test_a_tiny_engine_run_never_initialises_cuda_in_the_driver(ray_cluster, cuda_reported, tmp_path):
    """The whole driver side of a disaggregated tiny run (resolve, preflight, the Ray runtime, the
    ledger, checkpoints) with torch reporting 8 GPUs and CUDA's initialisation raising: it finishes."""
    from digenrl.config.run import load_config
    from digenrl.launch import run_engine
    from tests.helpers import QUIET, TINY

    cfg = load_config(
        None,
        [
            *TINY,
            *QUIET,
            "train.iterations=2",
            "placement.mode=disaggregated",
            "engine.tag=false",
            "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]",
        ],
    )
    result = run_engine(cfg, tmp_path / "run")
    assert [r["iteration"] for r in result.metrics] == [0, 1]


def test_workers_build_on_the_device_the_layout_gives_them(tiny_cfg, cuda_reported):
    """Each worker's device is resolved once, in the RunLayout (a logical CPU pool: ``cpu``; a GPU
    pool: ``cuda``, or ``cpu`` with ``train.device: cpu``), and a worker builds there without resolving
    ``train.device: auto`` itself: with torch reporting 8 GPUs, the workers of CPU pools build on the
    CPU and never initialise CUDA. Before, each worker re-resolved ``auto`` and built on ``cuda``."""
    from digenrl.engine.workers import EngineWorker
    from digenrl.placement.resolve import resolve

    pools = "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]"
    cfg = tiny_cfg("placement.mode=disaggregated", "engine.tag=false", pools)
    assert cfg.train.device == "auto"
    layout = resolve(cfg)
    for name, role in (("rollout0", "rollout"), ("trainer0", "trainer")):
        assert layout.worker(name).torch_device == "cpu"
        worker = EngineWorker(cfg, name, role, layout=layout)
        assert worker.init_error is None, worker.init_error
        assert worker.ready()["device"] == "cpu"
    on_gpus = "cluster.pools=[{name: rollout, device: H100}, {name: trainer, device: H100}]"
    gpu = resolve(tiny_cfg("placement.mode=disaggregated", "engine.tag=false", on_gpus))
    assert {gpu.worker(w.name).torch_device for w in gpu.workers} == {"cuda"}
    forced = resolve(
        tiny_cfg("placement.mode=disaggregated", "engine.tag=false", on_gpus, "train.device=cpu")
    )
    assert {forced.worker(w.name).torch_device for w in forced.workers} == {"cpu"}
