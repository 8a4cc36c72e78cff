"""Warm workers (tests/warm.py): which kept actor a run takes, what it releases, and a run
in kept processes equal to one in fresh processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digenrl.config.run import load_config
from tests import warm
from tests.helpers import TINY

ROLLOUT = warm.kind_of({"CPU": 1.0, "pool:rollout": 1}, 3)
TRAINER = warm.kind_of({"CPU": 0.5, "pool:trainer": 1}, 0)
TOTAL = {"CPU": 2.0, "pool:rollout": 2, "pool:trainer": 2}


@pytest.fixture
def released(monkeypatch):
    gone = []
    monkeypatch.setattr(warm, "release", lambda kept: gone.extend(k.name for k in kept))
    return gone


def pool_of(*kept) -> warm.WarmPool:
    pool = warm.WarmPool()
    pool.keep([warm.Kept(name, kind, f"pg-{name}", f"actor-{name}") for name, kind in kept])
    return pool


def test_the_kind_leaves_out_the_cpu_share_and_keeps_the_rest():
    assert ROLLOUT == warm.kind_of({"CPU": 0.05, "pool:rollout": 1}, 3)
    assert ROLLOUT != warm.kind_of({"CPU": 1.0, "pool:rollout": 1}, 0)  # restart budget
    assert ROLLOUT != warm.kind_of({"CPU": 1.0, "pool:trainer": 1}, 3)  # device
    assert warm.bundle_of(TRAINER) == {"CPU": warm.CPU_SHARE, "pool:trainer": 1}


def test_every_warm_actor_has_the_scoring_group_so_scoring_is_no_kind(monkeypatch):
    """A run whose rollout workers score beside their next unit and one that does not take the same
    kept actors: each warm actor is created with the scoring concurrency group."""
    import ray

    from digenrl.engine.cluster import ActorPlan

    made = []
    monkeypatch.setattr(warm, "reserve", lambda bundles, workers: "pg")
    monkeypatch.setattr(
        warm, "new_actor", lambda plan, group, index, cls, **kw: made.append(plan) or plan.name
    )
    pool = warm.WarmPool()
    monkeypatch.setattr(pool, "post", lambda key, args, kwargs: ("board", key))
    source = warm.WarmActors(pool)
    monkeypatch.setattr(ray, "cluster_resources", lambda: TOTAL)
    plans = [
        ActorPlan("rollout0", (), {}, {"CPU": 1.0, "pool:rollout": 1}, scoring, 3)
        for scoring in (False, True)
    ]
    source.start(load_config(None, TINY), plans, [])
    assert [p.scoring for p in made] == [True, True] and source.kinds[0] == source.kinds[1] == ROLLOUT
    assert [p.bundle for p in made] == [{"CPU": warm.CPU_SHARE, "pool:rollout": 1}] * 2


def test_a_kept_actor_is_taken_by_the_worker_it_ran_else_by_another_of_its_kind(released):
    pool = pool_of(("rollout0", ROLLOUT), ("trainer0", TRAINER), ("trainer1", TRAINER), ("rollout1", ROLLOUT))
    got = pool.take(["rollout0", "trainer2", "trainer1"], [ROLLOUT, TRAINER, TRAINER], TOTAL)
    # trainer1 takes its own although trainer2 asks first; trainer2 gets trainer0's
    assert [k.name for k in got] == ["rollout0", "trainer0", "trainer1"]
    assert released == [] and [k.name for k in pool.kept] == ["rollout1"]
    assert (pool.reused, pool.started) == (3, 0)
    pool = pool_of(("rollout0", ROLLOUT), ("trainer0", TRAINER))
    got = pool.take(["trainer0"], [ROLLOUT], TOTAL)  # never across kinds, whatever the name
    assert [k.name for k in got] == ["rollout0"] and [k.name for k in pool.kept] == ["trainer0"]


def test_kept_actors_not_taken_stay_while_their_devices_are_not_needed(released):
    pool = pool_of(("rollout0", ROLLOUT), ("trainer0", TRAINER), ("trainer1", TRAINER))
    got = pool.take(["rollout0", "trainer0"], [ROLLOUT, TRAINER], TOTAL)
    assert [k.name for k in got] == ["rollout0", "trainer0"]
    assert released == [] and [k.name for k in pool.kept] == ["trainer1"]
    assert pool.held() == {"CPU": warm.CPU_SHARE, "pool:trainer": 1}
    # the next run needs both trainer devices for workers of another kind: trainer1 goes
    other = warm.kind_of({"CPU": 1.0, "pool:trainer": 1}, 1)
    pool.keep(got)
    pool.take(["a", "b"], [other, other], TOTAL)
    assert released == ["trainer1", "trainer0"] and [k.name for k in pool.kept] == ["rollout0"]


def test_runs_that_must_start_fresh_actors():
    assert warm.eligible(load_config(None, TINY))
    fault = "engine.faults=[{worker: rollout0, unit: rollout-0-0}]"
    assert warm.eligible(load_config(None, [*TINY, fault]))  # a restart builds what the board says
    assert not warm.eligible(load_config(None, [*TINY, "engine.compile_rollout=on"]))


@pytest.mark.slow
def test_a_run_in_kept_processes_equals_one_in_fresh_processes(ray_cluster, tmp_path):
    """The same config twice: the second run builds every worker in the first run's processes
    (nothing started) and trains to the same weights and metrics."""
    from digenrl.launch import run_engine
    from digenrl.placement.resolve import resolve

    pool = warm.active()
    pool.clear()
    cfg = load_config(None, [*TINY, "train.iterations=2", "placement.mode=disaggregated"])
    first = run_engine(cfg, run_dir=tmp_path / "fresh")
    started, kept = pool.started, len(pool.kept)
    second = run_engine(cfg, run_dir=tmp_path / "warm")
    assert kept == len(resolve(cfg).workers) and pool.started == started  # all reused
    for a, b in zip(first.metrics, second.metrics, strict=True):
        assert {k: a[k] for k in ("loss", "grad_norm", "reward_mean")} == {
            k: b[k] for k in ("loss", "grad_norm", "reward_mean")
        }
    lora = "final/pytorch_lora_weights.safetensors"
    want, got = load_file(tmp_path / "fresh" / lora), load_file(tmp_path / "warm" / lora)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
def test_a_run_refused_while_its_workers_build_leaves_them_kept(ray_cluster, tmp_path):
    """Bad input that only a worker's build finds (LoRA targets matching no module) fails the run
    from ``ready``, before any process group or thread exists: its actors come back empty, stay kept,
    and the same run with good input builds every worker in them. The pool is not cleared first: the
    refused run may itself start in kept actors, which is what the suite's bad-input runs do."""
    from digenrl.engine import cluster
    from digenrl.errors import UserError
    from digenrl.launch import run_engine
    from digenrl.placement.resolve import resolve

    pool, source = warm.active(), cluster._installed  # (the suite's actor source: warm.WarmActors)
    base = [*TINY, "train.iterations=1", "placement.mode=disaggregated"]
    bad = load_config(None, [*base, "model.lora.targets=[to_qkv]"])
    asked = pool.started + pool.reused
    with pytest.raises(UserError, match="match no linear module"):
        run_engine(bad, run_dir=tmp_path / "bad")
    assert pool.started + pool.reused == asked + len(resolve(bad).workers)  # refused by its workers
    refused = set(source.keys)  # the refused run's actors, by their entries on the pool's board
    assert refused <= {k.key for k in pool.kept}
    started = pool.started
    run_engine(load_config(None, base), run_dir=tmp_path / "good")
    assert pool.started == started and set(source.keys) == refused  # built in those processes


@pytest.mark.slow
def test_a_run_that_failed_mid_run_leaves_its_idle_workers_kept(ray_cluster, tmp_path):
    """A run that fails after iteration 0 (its driver raises; iteration 1 may be in flight): the
    workers that empty themselves within seconds are kept (``WarmActors.finish``), and the same run
    built in them gives iteration 0's row of the failed run, which ran in fresh processes."""
    from digenrl.launch import run_engine
    from digenrl.placement.resolve import resolve

    class Stop(Exception):
        pass

    def stop(row):
        raise Stop

    pool = warm.active()
    pool.clear()
    cfg = load_config(None, [*TINY, "train.iterations=2", "placement.mode=disaggregated"])
    with pytest.raises(Stop):
        run_engine(cfg, run_dir=tmp_path / "failed", on_iteration=stop)
    assert len(pool.kept) == len(resolve(cfg).workers)
    started = pool.started
    again = run_engine(cfg, run_dir=tmp_path / "again")
    assert pool.started == started  # every worker built in a kept process
    (failed,) = [
        json.loads(line) for line in (tmp_path / "failed" / "metrics.jsonl").read_text().splitlines()
    ]
    keys = ("loss", "grad_norm", "reward_mean")
    assert {k: failed[k] for k in keys} == {k: again.metrics[0][k] for k in keys}


@pytest.mark.slow
@pytest.mark.faults
def test_a_kept_actor_restarted_by_ray_builds_this_runs_worker(ray_cluster, tmp_path):
    """Ray restarts a lost actor with the arguments it was created with: a kept actor's are an earlier
    run's (another seed here, so other weights, which the restart's checksum check would refuse).
    Killed mid-run, the kept rollout worker comes back as this run's, from the pool's board: the run
    ends as the same run without the fault, and only the restarted process is not kept."""
    from digenrl.launch import run_engine

    pool = warm.active()
    pool.clear()
    base = [*TINY, "train.iterations=2", "placement.mode=disaggregated"]
    run_engine(load_config(None, [*base, "train.seed=1"]), run_dir=tmp_path / "other_seed")
    started = pool.started
    fault = "engine.faults=[{worker: rollout0, unit: rollout-1-0}]"
    got = run_engine(load_config(None, [*base, fault]), run_dir=tmp_path / "fault")
    assert pool.started == started and got.metrics[-1]["worker_restarts"] == 1  # all in kept actors
    assert [k.name for k in pool.kept] == ["trainer0"]  # rollout0's restarted process is not kept
    want = run_engine(load_config(None, base), run_dir=tmp_path / "clean")
    assert [r["reward_mean"] for r in got.metrics] == pytest.approx([r["reward_mean"] for r in want.metrics])
    lora = "final/pytorch_lora_weights.safetensors"
    a, b = load_file(tmp_path / "fault" / lora), load_file(tmp_path / "clean" / lora)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4


def _swap_ranks(rank: int, _world: int, ports: tuple[int, int], out) -> None:
    """A run on a 2-rank mesh, then (as a kept process joins the next run) one on an equal-looking
    mesh with the ranks swapped: the second run's sharded op must report this process's new place."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from digenrl.distributed.fsdp import forget_meshes, trainer_mesh

    for run, (port, me) in enumerate(zip(ports, (rank, 1 - rank))):
        dist.init_process_group("gloo", rank=me, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
        y = distribute_tensor(torch.arange(8.0), trainer_mesh(), [Shard(0)]) * 2  # (cached sharding)
        if run == 1:
            torch.save((me, y.device_mesh.get_coordinate()), out / f"rank{me}.pt")
        dist.destroy_process_group()
        forget_meshes()  # (without it: rank 0 reports coordinate (1,), rank 1 (0,))


@pytest.mark.slow
def test_a_kept_process_forgets_its_old_mesh_coordinates(tmp_path):
    """What WarmWorker.retire clears (digenrl.distributed.fsdp.forget_meshes): DTensor caches an op's
    sharding with the mesh it first ran on, and meshes compare equal whatever this process's rank.
    Without forgetting, a process kept from a run where it was rank 1 reports coordinate 1 as rank 0
    (an FSDP checkpoint then writes two shards at one offset: seen with the suite run under xdist)."""
    from tests.dist_spawn import free_port, spawn

    spawn(_swap_ranks, 0, (free_port(), free_port()), tmp_path, nprocs=2)
    got = sorted(torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert got == [(0, (0,)), (1, (1,))]


def test_a_kept_process_lets_go_of_its_old_process_group(tmp_path):
    """After an FSDP2 optimizer step, the group destroyed and the caches forgotten (what
    WarmWorker.retire does), nothing holds the old mesh, so its gloo group is freed with it. DTensor's
    redistribute plans and cost caches held it: each kept trainer kept a live gloo group (threads,
    sockets to the old peers, rank 0's store server) per run -- seen as 6 of them in one process
    after the suite's runs, and once as a segfault in malloc when a peer of a leaked group died."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from digenrl.distributed.fsdp import forget_meshes, trainer_mesh
    from tests.dist_spawn import free_port

    before = gloo_threads()  # (this process may run other tests' groups too)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        mesh = trainer_mesh()
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(net[0], mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.AdamW(net.parameters())
        net(torch.randn(3, 4)).sum().backward()
        opt.step()
        old = weakref.ref(mesh)
    finally:
        dist.destroy_process_group()
    forget_meshes()
    del mesh, net, opt
    gc.collect()
    assert old() is None
    assert gloo_threads() == before  # gloo's loop threads went with the group


def gloo_threads() -> int:
    """This process's threads named by gloo (Linux: /proc; elsewhere 0)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return 0
    return sum("gloo" in Path(t, "comm").read_text() for t in tasks.iterdir() if Path(t, "comm").exists())


class _Cycle:
    def __init__(self):
        self.me = self  # freed by the cyclic collector only


def test_a_kept_process_collects_each_runs_cycles_without_refreezing_them(monkeypatch):
    """A worker's first build is frozen (``gc_paused_then_frozen``); a kept process's first retire
    unfreezes, collects and freezes what stays, and its later builds (``WarmWorker.rebuild``) are not
    frozen: their cycles die at the next retire, and the frozen count does not grow run by run (a
    frozen build would make every retire traverse the imports again, ~0.36 s of CPU each)."""
    import gc
    import weakref

    from digenrl.engine import workers
    from digenrl.engine.worker_setup import gc_paused_then_frozen

    built = []
    record = lambda self, *a, **k: built.append(self.freeze_build)  # noqa: E731
    monkeypatch.setattr(workers.EngineWorker, "__init__", record)
    monkeypatch.setattr(warm, "_refrozen", False)
    unfrozen = gc.get_freeze_count() == 0
    try:
        with gc_paused_then_frozen():  # the first build
            first = weakref.ref(_Cycle())
        warm.collect_the_run()  # the first retire
        assert first() is None
        frozen = gc.get_freeze_count()
        worker = warm.WarmWorker.__new__(warm.WarmWorker)
        for _ in range(2):
            worker.rebuild()
            with gc_paused_then_frozen(freeze=worker.freeze_build):  # what EngineWorker.__init__ does
                later = weakref.ref(_Cycle())
            assert gc.get_freeze_count() <= frozen  # never grows (another thread's frozen objects may die)
            warm.collect_the_run()
            assert later() is None
        assert built == [False, False]
    finally:
        if unfrozen:  # (this test process froze nothing before)
            gc.unfreeze()


def test_a_reward_actor_is_kept_only_where_a_mistake_cannot_pass_unseen():
    from tests.warm_rewards import reward_kind

    small = ["reward.service={num_cpus: 0.1}"]
    assert reward_kind(load_config(None, [*TINY, *small])) == (0.1,)
    assert reward_kind(load_config(None, [*TINY, "reward.service={}"])) is None  # a whole CPU
    assert reward_kind(load_config(None, [*TINY, "reward.service={num_cpus: 0.1, num_gpus: 1}"])) is None
    fault = "engine.faults=[{worker: rollout0, unit: rollout-0-0}]"
    assert reward_kind(load_config(None, [*TINY, *small, fault])) is None


@pytest.mark.slow
def test_a_kept_reward_actor_scores_the_next_run_as_a_fresh_one(ray_cluster, tmp_path):
    """The same run with a reward service twice: the second builds its reward in the first run's
    reward actor (none started) and gets the same rewards; a run whose reward config is bad fails
    from the kept actor's ``ready`` with the one-line error, and the actor goes."""
    from digenrl.errors import UserError
    from digenrl.launch import run_engine

    rewards = warm.active().rewards
    base = [*TINY, "train.iterations=1", "placement.mode=disaggregated", "reward.service={num_cpus: 0.1}"]
    cfg = load_config(None, base)
    first = run_engine(cfg, run_dir=tmp_path / "first")
    started, reused = rewards.started, rewards.reused
    second = run_engine(cfg, run_dir=tmp_path / "second")
    assert (rewards.started, rewards.reused) == (started, reused + 1)
    assert [r["reward_mean"] for r in first.metrics] == [r["reward_mean"] for r in second.metrics]
    bad = load_config(None, [*base, "reward.components=[{name: ocr}]"])  # prompts without text to read
    with pytest.raises(UserError, match="quotes no text"):
        run_engine(bad, run_dir=tmp_path / "bad")
    assert rewards.kept is None and rewards.running is None
