"""Shared test helpers."""

import sys

import pytest


def cli(monkeypatch, capsys, *argv):
    """Run the ``digenrl`` console entry point in-process: returns (exit code, stdout, stderr)."""
    from digenrl.cli.app import main

    monkeypatch.setattr(sys, "argv", ["digenrl", *argv])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def local_ray(rollout: int = 1, trainer: int = 1):
    """A 2-CPU Ray cluster in this process with ``rollout`` + ``trainer`` logical devices (the pools
    of the default config); a generator for module-scoped fixtures: ``yield from local_ray()``."""
    import ray

    ray.init(
        num_cpus=2,
        resources={"pool:rollout": rollout, "pool:trainer": trainer},
        include_dashboard=False,
        logging_level="WARNING",
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


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
