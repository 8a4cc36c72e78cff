"""The Ray engine end to end on the tiny FLUX, in every mode: the invariants of docs/architecture.md
read back from the run directory (timeline.json: what each worker actually ran and trained),
equality with the single-process trainer when on-policy, verified weight sync, and errors that
come in seconds instead of hangs. One Ray cluster (2 CPUs, 2 + 2 logical devices) per module."""

from __future__ import annotations

import importlib
import json
import os
import time

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine import weight_sync  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.errors import UserError, WeightSyncError  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from digenrl.run.rundir import read_metrics  # noqa: E402
from digenrl.units.types import TrainUnit  # noqa: E402
from tests.helpers import (  # noqa: E402
    FULL_MODE,
    POOLS,
    TINY,
    assert_timeline_invariants,
    cli,
)

BASE = [
    *TINY,
    *FULL_MODE,  # the knobs a mode below leaves unset: the full mode's (GAP, TAG), not the default run's
    "train.iterations=2",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
]
DISAGG = ["placement.mode=disaggregated"]
TWO_TRAINERS = ["cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]"]

MODES = {
    # colocated also runs global-std advantages (the scheduler's wait_for_full_batch path) and samples
    # at its own batch (engine.colocated_batch: forwards of 1 where the trainer's are one of 4;
    # tests/test_colocated_batch.py checks larger batches)
    "colocated": ["placement.mode=colocated", "algorithm.std=global", "engine.colocated_batch=1"],
    "sync": DISAGG + ["engine.gap=false", "engine.tag=false", "engine.tsp_degree=1"],
    # gap also scores through the shared reward actor (reward.service)
    "gap": DISAGG + ["engine.gap=true", "engine.tag=false", "reward.service={num_cpus: 0.1}"],
    "gap_tsp": DISAGG + TWO_TRAINERS + ["engine.tag=false", "engine.tsp_degree=2"],
    # (GAP + TSP + TAG on-policy is "minibatch": the same knobs, with two optimizer steps and an EMA)
    # async also scores through the reward actor: TAG trainer ranks release rollout units too; its TAG
    # is elastic (BTS decides each TAG point on the unit times the run measures)
    "async": DISAGG
    + TWO_TRAINERS
    + ["engine.tag=auto", "engine.tsp_degree=2", "engine.max_staleness=1", "reward.service={num_cpus: 0.1}"],
    # GAP + TSP + TAG with mini-batch PPO: two optimizer steps per iteration (one per rollout unit), over
    # two ranks with TAG; with an EMA (rank 0 keeps it; final/ holds it)
    "minibatch": DISAGG
    + TWO_TRAINERS
    + [
        "engine.tag=true",
        "engine.tsp_degree=2",
        "train.optimizer_steps=2",
        "train.ema={decay: 0.5, every: 1}",
    ],
    # sub-group units (G/2 samples each) scored by the reward actor: a group trains once both halves are
    # in; elastic TAG
    "sub_groups": DISAGG
    + [
        "engine.unit_samples=2",
        "engine.tag=auto",
        "reward.service={num_cpus: 0.1}",
        "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
    ],
    # colocated with global std, sub-group units (every device gets half a group) and mini-batches: each
    # part of a group holds one mini-batch's slice of it
    "colocated_sub_groups_minibatch": [
        "placement.mode=colocated",
        "algorithm.std=global",
        "engine.unit_samples=2",
        "train.optimizer_steps=2",
    ],
}


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """LocalTrainer runs (per advantage std and optimizer steps): final LoRA tensors and metrics rows."""
    out = {}

    def get(std: str, train: tuple[str, ...] = ()):
        """``train``: the mode's train.* overrides (optimizer steps, EMA)."""
        if (std, train) not in out:
            path = tmp_path_factory.mktemp(f"local-{std}")
            result = LocalTrainer(load_config(None, BASE + [f"algorithm.std={std}", *train])).run(path)
            out[std, train] = (load_file(path / "final" / "pytorch_lora_weights.safetensors"), result.metrics)
        return out[std, train]

    return get


ALL_POOLS = dict(POOLS)  # the logical devices of the suite's Ray cluster


def free_pools() -> dict:
    """Free logical devices, once the (asynchronous) release of a run's reservation is through, plus
    those of the warm workers a finished run kept for the next (conftest ``ray_cluster``): a run
    leaves nothing behind but those."""
    from tests import warm

    kept = warm.active().held() if warm.active() is not None else {}
    for _ in range(50):
        have = ray.available_resources()
        free = {k: have.get(k, 0) + kept.get(k, 0) for k in ALL_POOLS}
        if free == ALL_POOLS:
            break
        time.sleep(0.1)
    return free


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.slow
def test_mode_invariants(mode, cluster, reference, tmp_path):
    cfg = load_config(None, BASE + MODES[mode])
    result = run_engine(cfg, run_dir=tmp_path)
    e, n_iter, n_groups = cfg.engine, cfg.train.iterations, cfg.train.prompts_per_iteration
    stale, n_steps = e.max_staleness, cfg.train.optimizer_steps

    for name in ("config.yaml", "metrics.jsonl", "timeline.json", "timeline.png", "final", "samples"):
        assert (tmp_path / name).exists(), name
    rows = read_metrics(tmp_path)
    assert rows == result.metrics and [r["iteration"] for r in rows] == list(range(n_iter))
    for r in rows:
        for key in (
            "version",
            "reward_mean",
            "loss",
            "samples",
            "wall_s",
            "samples_per_s",
            "bubble_fraction",
            "sync_s",
            "sync_bytes",
        ):
            assert key in r, key
        assert 0 <= r["bubble_fraction"] < 1 and r["samples"] == n_groups * cfg.algorithm.group_size

    tl = Timeline.from_chrome_trace(tmp_path / "timeline.json")
    if isinstance(e.colocated_batch, int):  # the layout holds it, and every worker sampled at it
        assert json.loads((tmp_path / "layout.json").read_text())["settings"]["colocated_batch"] == 1
        assert {r.args["batch"] for r in tl.of("rollout")} == {1}
    # every group generated once within the staleness bound, trained once per TSP rank and mini-batch
    # from samples of one version, one step per rank and mini-batch, the last publishing
    assert_timeline_invariants(cfg, tl)
    rollouts, trains, steps = tl.of("rollout"), tl.of("train"), tl.of("step")
    parts = cfg.algorithm.group_size // (e.unit_samples or cfg.algorithm.group_size)
    assert all(
        r.args["samples"] == cfg.algorithm.group_size // parts * len(r.args["groups"]) for r in rollouts
    )
    made_by = {(r.iteration, tuple(r.args["groups"])): r.version for r in rollouts}
    assert all(made_by[(r.iteration, tuple(r.args["groups"]))] == r.version for r in rollouts), (
        "a group's parts generated with different versions"
    )
    assert not tl.follows  # no sharded or sequence-parallel groups here: every trainer rank steps
    if cfg.placement.mode == "colocated":  # phases never overlap
        work = trains + steps
        assert not [(r.uid, w.uid) for r in rollouts for w in work if r.start < w.end and w.start < r.end]
        assert not tl.of("sync")  # the all-reduce keeps every rank identical
    else:  # every version a rollout worker used was fetched and verified once per worker
        fetched = {(s.worker, s.version) for s in tl.of("sync") if s.args["direction"] == "fetch"}
        used = {
            (r.worker, r.version) for r in rollouts if tl.workers[r.worker] == "rollout" and r.version > 0
        }
        assert fetched == used and all(s.args["bytes"] > 0 for s in tl.of("sync"))
    check_reward_events(tl, rows, service=cfg.reward.service is not None)
    if e.tag == "auto":  # BTS: a TAG unit carries its decision, a publish the decisions it ended
        assert all("bts" in r.args for r in rollouts if tl.workers[r.worker] == "trainer")
        decided = [s.args["bts"] for s in steps if "bts" in s.args]
        assert all(d["decisions"] >= d["inserted"] >= 0 for d in decided)

    if cfg.train.ema is not None:  # rank 0 kept the average over every optimizer step, in its checkpoint
        last = tmp_path / "checkpoints" / f"iter-{n_iter:06d}"
        state = json.loads((last / "state.json").read_text())
        assert (last / "ema.safetensors").is_file() and state["ema"]["steps"] == n_iter * n_steps
    if stale == 0:  # on-policy: the same update as the single-process trainer
        ref_weights, ref_rows = reference(
            cfg.algorithm.std, tuple(o for o in MODES[mode] if o.startswith("train."))
        )
        got = load_file(tmp_path / "final" / "pytorch_lora_weights.safetensors")
        assert got.keys() == ref_weights.keys()
        # The summed gradient is the same up to float associativity (units accumulate on
        # different ranks); Adam's g / (|g| + eps) amplifies that for near-zero entries, so the
        # parameters get 1e-4 (about 1% of one lr=1e-2 step); the pre-clip gradient norm, which
        # would catch a unit missing or counted twice, must match to 1e-5.
        for k in got:
            torch.testing.assert_close(got[k], ref_weights[k], atol=1e-4, rtol=0)
        for mine, theirs in zip(rows, ref_rows):
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
            assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
            # the trainer ranks recompute every on-policy log-prob exactly as the rollout worker got it
            # (to rounding where the workers sampled at their own batch)
            assert theirs["logprob_mismatch"] == 0.0
            if isinstance(e.colocated_batch, int):  # (0.0 where the two batchings round alike)
                assert mine["logprob_mismatch"] < 1e-4
            else:
                assert mine["logprob_mismatch"] == 0.0
            if n_steps == 1:  # one step: every sample on-policy, the ratio 1
                assert mine["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
            else:  # the later mini-batches see the moved weights: PPO's ratio, the same as the local one
                assert mine["ratio_mean"] == pytest.approx(theirs["ratio_mean"], abs=1e-6)
                assert mine["clip_frac"] == pytest.approx(theirs["clip_frac"], abs=1e-6)
                assert mine["ratio_max"] > 1 + 1e-5 or mine["ratio_min"] < 1 - 1e-5
    assert free_pools() == ALL_POOLS, "placement group or actors left behind"


# -- the reward service: scoring off the critical path ---------------------------------------

SERVICE = DISAGG + ["engine.gap=true", "engine.tag=false", "reward.service={num_cpus: 0.1}"]


@pytest.fixture(scope="module")
def slow_clip(tmp_path_factory):
    """A random CLIP big enough (192 px, 4 layers) that scoring a unit takes about as long as
    generating one: the overlap is then visible, as with real reward models."""
    from test_model_rewards import make_tiny_clip

    return make_tiny_clip(tmp_path_factory.mktemp("slow-clip"), image_size=192, hidden=64, layers=4)


def clip_reward(path) -> str:
    return f"reward.components=[{{name: clipscore, args: {{path: {path}}}}}]"


@pytest.fixture(scope="module")
def clip_local(slow_clip, tmp_path_factory):
    """The single-process trainer scoring ``slow_clip`` inline, 4 prompts per iteration, then
    ``extra``: final LoRA tensors and metrics rows, run once per ``extra`` for the engine runs below."""
    out = {}

    def get(*extra: str):
        if extra not in out:
            path = tmp_path_factory.mktemp("clip-local")
            cfg = load_config(None, BASE + ["train.prompts_per_iteration=4", clip_reward(slow_clip), *extra])
            result = LocalTrainer(cfg).run(path)
            out[extra] = (load_file(path / "final" / "pytorch_lora_weights.safetensors"), result.metrics)
        return out[extra]

    return get


@pytest.mark.slow
def test_reward_service_scores_while_the_next_unit_generates(cluster, slow_clip, clip_local, tmp_path):
    # 4 rollout units per iteration: the actor scores a unit slower than the worker generates
    # one, so units queue for it and overlap with generation even on a loaded machine
    overrides = BASE + SERVICE + ["train.prompts_per_iteration=4", clip_reward(slow_clip)]
    cfg = load_config(None, overrides)
    result = run_engine(cfg, run_dir=tmp_path / "service")
    tl = Timeline.from_chrome_trace(tmp_path / "service" / "timeline.json")
    rows = read_metrics(tmp_path / "service")
    check_reward_events(tl, rows, service=True)
    rollouts = {r.uid: r for r in tl.of("rollout")}
    position = {uid: (r.iteration, r.args["groups"][0]) for uid, r in rollouts.items()}
    overlapped = [
        (w.uid, r.uid)
        for w in tl.of("reward")
        for r in rollouts.values()
        if position[r.uid] > position[w.uid] and w.start < r.end and r.start < w.end
    ]
    assert overlapped, "no unit was scored while a later one generated"
    # ... and every train unit started only once its samples were scored
    scored = {w.uid: w.end for w in tl.of("reward")}
    assert all(t.start >= scored[f"rollout-{t.iteration}-{t.args['groups'][0]}"] for t in tl.of("train"))
    assert all(r["reward_latency_s/clipscore"] > 0 for r in rows)

    # the same update as the single-process trainer, which scores inline (as test_mode_invariants)
    ref, local_rows = clip_local()
    got = load_file(tmp_path / "service" / "final" / "pytorch_lora_weights.safetensors")
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, local_rows, strict=True):
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tag", [False, True])
def test_a_model_reward_is_scored_on_the_rollout_worker_beside_its_next_unit(
    cluster, slow_clip, clip_local, tmp_path, tag
):
    """A model reward without reward.service: each unit is scored after its decode on a rollout
    worker's device (a TAG rank's unit too: its pixels go to a rollout worker), in a side call that
    overlaps that worker's next unit; the update is the local trainer's (which scores inline). The
    in-training eval too: trainer rank 0 samples it, a rollout worker scores it."""
    overrides = BASE + DISAGG + ["engine.gap=true", f"engine.tag={str(tag).lower()}"]
    overrides += ["train.prompts_per_iteration=4", clip_reward(slow_clip), "output.eval_every=2"]
    result = run_engine(load_config(None, overrides), run_dir=tmp_path / "engine")
    tl = Timeline.from_chrome_trace(tmp_path / "engine" / "timeline.json")
    rollouts, rewards = {r.uid: r for r in tl.of("rollout")}, tl.of("reward")
    assert sorted(w.uid for w in rewards) == sorted(rollouts)
    for w in rewards:  # on a rollout worker's row, after the unit's decode
        assert tl.workers[w.worker] == "rollout" and not w.args["service"]
        assert w.start >= rollouts[w.uid].end - 1e-3
        if tl.workers[rollouts[w.uid].worker] == "rollout":
            assert w.worker == rollouts[w.uid].worker
    overlapped = [
        (w.uid, r.uid)
        for w in rewards
        for r in rollouts.values()
        if r.worker == w.worker and r.uid != w.uid and w.start < r.end and r.start < w.end
    ]
    assert overlapped, "no unit was scored while its worker generated the next one"
    scored = {w.uid: w.end for w in rewards}
    assert all(t.start >= scored[f"rollout-{t.iteration}-{t.args['groups'][0]}"] for t in tl.of("train"))
    assert all(r["reward_latency_s/clipscore"] > 0 for r in result.metrics)

    ref, local_rows = clip_local("output.eval_every=2")
    got = load_file(tmp_path / "engine" / "final" / "pytorch_lora_weights.safetensors")
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, local_rows, strict=True):
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    evals = [(m, t) for m, t in zip(result.metrics, local_rows) if "eval/reward_mean" in t]
    assert evals and all(
        m["eval/clipscore"] == pytest.approx(t["eval/clipscore"], abs=1e-5) for m, t in evals
    )


@pytest.mark.slow
def test_a_rollout_worker_at_its_own_batch_matches_the_local_trainer_to_rounding(
    cluster, reference, tmp_path
):
    """engine.rollout_batch 3: the rollout worker forwards a unit of 8 samples 3, 3 and 2 at a time,
    the trainer ranks one at a time -- the on-policy ratio is 1 to fp32 rounding (logprob_mismatch > 0
    and < 1e-4), the update the local trainer's within the engine's tolerance."""
    train = ("train.micro_batch=1",)
    own = [*train, "engine.unit_groups=2", "engine.rollout_batch=3"]
    result = run_engine(load_config(None, BASE + MODES["sync"] + own), run_dir=tmp_path)
    assert json.loads((tmp_path / "layout.json").read_text())["settings"]["rollout_batch"] == 3
    ref_weights, ref_rows = reference("per_prompt", train)
    got = load_file(tmp_path / "final" / "pytorch_lora_weights.safetensors")
    for k in got:
        torch.testing.assert_close(got[k], ref_weights[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref_rows, strict=True):
        assert 0.0 < mine["logprob_mismatch"] < 1e-4 and theirs["logprob_mismatch"] == 0.0
        assert mine["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)


@pytest.mark.slow
def test_reward_error_in_the_actor_reaches_the_cli(cluster, tmp_path, monkeypatch, capsys):
    """A UserError raised while the actor scores (a prompt the dry run did not see names no
    colour) ends the run: one line on stderr, exit 2."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red car\na blue bird\n" + "".join(f"a thing number {i}\n" for i in range(8)))
    sets = [a for o in BASE + SERVICE + [f"prompts.file={prompts}"] for a in ("--set", o)]
    code, _, err = cli(monkeypatch, capsys, "train", *sets, "--run-dir", str(tmp_path / "run"))
    assert code == 2, err
    assert err.startswith("error: reward prompt_color: prompt 'a thing number") and "names no colour" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert free_pools() == ALL_POOLS


@pytest.mark.slow
def test_bad_reward_with_service_fails_before_training(cluster, tmp_path):
    """With reward.service only the reward actor loads the models: its error reaches the caller,
    in seconds, and everything is released."""
    missing = f"reward.components=[{{name: clipscore, args: {{path: {tmp_path / 'no-clip'}}}}}]"
    cfg = load_config(None, BASE + SERVICE + [missing])
    expect_user_error(
        cfg, ["reward.components.0.args.path", "no-clip", "not found"], run_dir=tmp_path / "run"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or read_metrics(tmp_path / "run") == []
    assert free_pools() == ALL_POOLS


def test_late_scores_follow_the_nan_policy(tmp_path):
    """The driver's side of a released unit (no Ray): NaN scores that arrive after the worker
    moved on (``nan_policy: drop``, passed on by the actor) get advantage 0, and are counted;
    the scoring span lands on the reward row."""
    from digenrl.engine.runtime import RayBackend
    from digenrl.placement.resolve import resolve
    from digenrl.rewards import reward_metrics
    from digenrl.rewards.base import Scores
    from digenrl.schedule.scheduler import Scheduler

    cfg = load_config(None, BASE + SERVICE + ["reward.nan_policy=drop"])
    layout = resolve(cfg)
    sched = Scheduler(layout.scheduler, layout.workers)
    engine = RayBackend(cfg, layout, sched, actors={}, out=None)
    unit = sched.next_unit("rollout0")
    sched.release(unit)
    assert sched.next_unit("trainer0") is None  # nothing to train before the scores
    engine.unscored[unit.uid] = {"terms": 8, "prompts": ["a red car"] * 4, "group_ids": [0], "preview": None}
    total = torch.tensor([0.2, float("nan"), 0.6, 0.4])
    t = engine.t0
    engine.scored(
        unit, Scores(total, {"prompt_color": total}, t + 1.0, t + 1.5, {"prompt_color": 0.5}, 0.25, 1)
    )
    sched.complete(unit)
    adv = engine.ledger.batches[unit.uid].advantages
    assert adv[1] == 0 and not torch.isnan(adv).any() and adv[0] < 0 < adv[2]
    batch = engine.ledger.batches[unit.uid]
    assert (
        reward_metrics(batch.rewards, batch.reward_parts)["reward_nan"] == 1
    )  # as the metrics row counts it
    (event,) = engine.timeline.of("reward")
    assert (event.worker, event.start, event.end, event.args["queue_depth"]) == ("reward", 1.0, 1.5, 1)
    assert engine.ledger.reward_calls[0] == [
        {"seconds": 0.5, "timings": {"prompt_color": 0.5}, "wait_s": 0.25, "queue_depth": 1}
    ]
    assert isinstance(sched.next_unit("trainer0"), TrainUnit)


def check_reward_events(tl: Timeline, rows: list[dict], service: bool) -> None:
    """Inline: each rollout unit's scoring nests in it, on its worker's row. Service: once per
    rollout unit on the reward actor's own row (pool ``service``, not a device: outside the
    bubble), measured in the actor, after the unit's generation began. Latency per reward in
    every metrics row; the service's queue depth only with the service."""
    rollouts = {r.uid: r for r in tl.of("rollout")}
    rewards = tl.of("reward")
    assert sorted(w.uid for w in rewards) == sorted(rollouts)
    if service:
        assert {w.worker for w in rewards} == {"reward"} and tl.workers["reward"] == "service"
        assert all(w.args["service"] and rollouts[w.uid].start <= w.start for w in rewards)
    else:
        assert all(
            not w.args["service"]
            and w.worker == rollouts[w.uid].worker
            and rollouts[w.uid].start <= w.start <= w.end <= rollouts[w.uid].end
            for w in rewards
        )
    for r in rows:
        names = [k.removeprefix("reward/") for k in r if k.startswith("reward/")]
        assert names and all(r[f"reward_latency_s/{n}"] > 0 for n in names)
        assert ("reward_queue_depth" in r) == ("reward_wait_s" in r) == service
        if service:
            assert r["reward_queue_depth"] >= 0 and r["reward_wait_s"] >= 0


@pytest.mark.slow
def test_weight_sync_is_verified(cluster):
    from digenrl.policy.model import Policy

    cfg = load_config(None, BASE)
    sender, receiver = Policy(cfg), Policy(cfg, trainable=False)
    with torch.no_grad():
        for p in sender.params:
            p.add_(0.01)
    sender.version = 1
    packet, event = weight_sync.publish(sender)
    assert event["kind"] == "sync" and event["args"]["bytes"] == packet.nbytes > 0
    keys = set(receiver.weights())

    def corrupted(change):
        state = ray.get(packet.ref)
        change(state)
        return weight_sync.WeightPacket(
            packet.version, packet.checksum, packet.keys, packet.nbytes, ray.put(state)
        )

    first = packet.keys[0]
    bad = {
        "value": corrupted(lambda s: s[first].add_(1e-3)),
        "missing key": corrupted(lambda s: s.pop(first)),
        "unexpected key": corrupted(lambda s: s.__setitem__("extra.lora_A.weight", torch.zeros(1))),
    }
    for what, wrong in bad.items():
        with pytest.raises(WeightSyncError):
            weight_sync.load(receiver, wrong, keys, iteration=1)
        assert receiver.version == 0, what
    with pytest.raises(WeightSyncError):  # the receiver expects a module the sender did not ship
        weight_sync.load(receiver, packet, keys | {"transformer.extra.lora_B.weight"}, iteration=1)

    event = weight_sync.load(receiver, packet, keys, iteration=1)
    assert receiver.version == 1 and event["args"]["direction"] == "fetch"
    from digenrl.policy.lora import checksum

    assert checksum(receiver.weights()) == checksum(sender.weights())


def unreachable(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the refusal came after {what}")

    return refuse


def expect_user_error(cfg, fragments: list[str], **kwargs) -> None:
    """``run_engine`` refuses ``cfg`` with a UserError holding every fragment. (How early it refuses
    is shown by what the caller forbids it to reach, not by a clock: the machine may be loaded.)"""
    with pytest.raises(UserError) as err:
        run_engine(cfg, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.slow
def test_unsatisfiable_cluster_fails_fast(cluster, tmp_path, monkeypatch):
    """Refused from the cluster's resources, before a placement group could wait for them."""
    module = importlib.import_module("ray.util.placement_group")  # (ray.util.placement_group: the function)
    monkeypatch.setattr(module, "placement_group", unreachable("a placement group"))
    have = POOLS["pool:rollout"]
    more = load_config(
        None, BASE + DISAGG + [f"cluster.pools=[{{name: rollout, count: {have + 1}}}, {{name: trainer}}]"]
    )
    expect_user_error(
        more,
        [f"pool:rollout {have + 1} needed, {have} exist", f"{have + 1} x cpu for pool 'rollout'"],
        ray_address=cluster,
        run_dir=tmp_path / "a",
    )
    h800 = load_config(
        None, BASE + DISAGG + ["cluster.pools=[{name: rollout, device: H800}, {name: trainer}]"]
    )
    expect_user_error(h800, ["'H800'", "pool:trainer"], run_dir=tmp_path / "b")
    assert free_pools() == ALL_POOLS


@pytest.mark.slow
def test_wrong_ray_address_fails_fast(cluster, tmp_path, monkeypatch):
    """Refused by a probe of the address, before ray.init's minute of retries."""
    monkeypatch.setattr(ray, "init", unreachable("ray.init"))
    cfg = load_config(None, BASE + DISAGG)
    expect_user_error(
        cfg, ["127.0.0.1:1", "no Ray cluster answers"], ray_address="127.0.0.1:1", run_dir=tmp_path
    )


@pytest.mark.slow
def test_failure_releases_everything(cluster, tmp_path):
    class Stop(Exception):
        pass

    def stop(row):
        raise Stop

    cfg = load_config(None, BASE + DISAGG)
    with pytest.raises(Stop):
        run_engine(cfg, run_dir=tmp_path, on_iteration=stop)
    assert free_pools() == ALL_POOLS
    assert json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]  # kept for debugging
    assert len(read_metrics(tmp_path)) == 1


# -- placement as data: pure functions, no cluster needed -----------------------------------


def test_engine_workers_per_placement():
    from digenrl.placement.resolve import resolve

    pools = "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 3}]"
    colocated = resolve(load_config(None, BASE + ["placement.mode=colocated", pools])).workers
    assert [(s.name, s.role) for s in colocated] == [(f"rollout{i}", "both") for i in range(2)] + [
        (f"trainer{i}", "both") for i in range(3)
    ]
    disagg = resolve(load_config(None, BASE + DISAGG + [pools])).workers
    assert [s.role for s in disagg] == ["rollout"] * 2 + ["trainer"] * 3  # rollout workers ask first
    with pytest.raises(UserError, match="different pools"):
        resolve(load_config(None, BASE + DISAGG + ["placement.trainer_pool=rollout"])).workers
    with pytest.raises(UserError, match="train.device"):
        resolve(load_config(None, BASE + DISAGG + ["train.device=cuda"])).workers


def test_resource_bundles_for_gpu_pools():
    from digenrl.engine.resources import resource_bundles
    from digenrl.placement.resolve import resolve

    gpus = load_config(
        None,
        BASE
        + DISAGG
        + ["cluster.pools=[{name: rollout, device: H20, count: 2}, {name: trainer, device: h800, count: 2}]"],
    )
    workers = resolve(gpus).workers
    cluster = {"CPU": 64, "GPU": 8, "accelerator_type:H20": 1, "H800": 4, "node:1.2.3.4": 1}
    bundles = resource_bundles(workers, cluster)
    assert bundles[0] == {"CPU": 1.0, "GPU": 1, "accelerator_type:H20": 0.001}  # Ray's detected type
    assert bundles[2] == {"CPU": 1.0, "GPU": 1, "H800": 1}  # a custom resource per device, any case
    with pytest.raises(UserError, match="GPU 4 needed, 3 exist"):
        resource_bundles(workers, {**cluster, "GPU": 3})
    with pytest.raises(UserError, match="'h800'"):
        resource_bundles(workers, {"CPU": 64, "GPU": 8, "accelerator_type:H20": 1})
    # CPU shares fit the CPUs left beside the reward actor: never a placement that waits forever
    cpu = resolve(load_config(None, BASE + DISAGG)).workers
    shares = resource_bundles(cpu, {"CPU": 2, "pool:rollout": 1, "pool:trainer": 1}, reserve={"CPU": 1})
    assert sum(b["CPU"] for b in shares) <= 1 and shares[0]["pool:rollout"] == 1


# -- sub-group units: the same samples, advantages only over whole groups -------------------------


def test_a_part_of_a_group_generates_the_whole_group_units_samples():
    """Samples lo..hi-1 of a group generated as a sub-group unit are the ones a whole-group unit
    generates (same noise, SDE draws, trained steps, rewards), for DanceGRPO's per-sample random steps too."""
    from digenrl.data.prompts import PromptSampler, load_prompts
    from digenrl.policy.model import Policy
    from digenrl.rewards import build_reward
    from digenrl.units.rollout import rollout_unit, scored

    cfg = load_config(None, BASE + ["algorithm.timesteps.mode=random", "algorithm.timesteps.fraction=0.6"])
    torch.manual_seed(cfg.train.seed)
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(1, 2)
    reward, policy = build_reward(cfg.reward), Policy(cfg)
    whole = scored(rollout_unit(policy, prompts[1:2], [1], 1, cfg.train.seed), reward)
    halves = [
        scored(rollout_unit(policy, prompts[1:2], [1], 1, cfg.train.seed, (lo, lo + 2)), reward)
        for lo in (0, 2)
    ]
    assert [len(h) for h in halves] == [2, 2] and halves[1].prompts == whole.prompts[2:]
    for name in ("latents", "log_probs", "train_idx", "rewards"):
        joined = torch.cat([getattr(h, name) for h in halves])
        torch.testing.assert_close(joined, getattr(whole, name), atol=1e-5, rtol=0)  # batch size 2 vs 4
    assert not torch.equal(halves[0].train_idx, halves[1].train_idx)  # per-sample steps, not one row copied


def test_advantages_wait_for_every_part_of_a_group(tmp_path):
    """The ledger (no Ray): a group's advantages exist only once all its parts are scored; asking for a
    part's earlier raises; then they equal the whole group's advantages, split in part order."""
    from digenrl.algorithms.grpo import group_advantages
    from digenrl.engine.ledger import IterationLedger
    from digenrl.placement.resolve import resolve
    from digenrl.schedule.scheduler import Scheduler

    cfg = load_config(None, BASE + DISAGG + ["engine.unit_samples=2", "engine.tag=false"])
    sched_cfg = resolve(cfg).scheduler
    assert sched_cfg.group_parts == 2 and sched_cfg.units_per_iteration == 4
    sched = Scheduler(sched_cfg, resolve(cfg).workers)
    ledger = IterationLedger(cfg, sched_cfg, Timeline(), out=None)
    first = sched.next_unit("rollout0")
    sched.complete(first)
    second = sched.next_unit("rollout0")
    assert (first.groups, first.part, second.groups, second.part) == ((0,), 0, (0,), 1)
    rewards = torch.tensor([0.1, 0.9, 0.4, 0.3])
    summary = {"terms": 6, "prompts": ["p"] * 2, "group_ids": [0], "preview": None}
    ledger.rolled_out(second, {**summary, "rewards": rewards[2:], "reward_parts": {"r": rewards[2:]}})
    assert sched.next_unit("trainer0") is None  # the scheduler holds the half group back too
    early = TrainUnit("train-0-1-0", 0, second.uid, (0,), 0, 0, 1, 0)
    with pytest.raises(RuntimeError, match="before every part"):
        ledger.advantages(early)
    ledger.rolled_out(first, {**summary, "rewards": rewards[:2], "reward_parts": {"r": rewards[:2]}})
    sched.complete(second)
    expected = group_advantages(
        rewards, 4, cfg.algorithm.std, cfg.algorithm.adv_clip, ddof=cfg.algorithm.std_ddof
    )
    got = torch.cat([ledger.batches[u.uid].advantages for u in (first, second)])
    torch.testing.assert_close(got, expected)
    (whole,) = ledger.iteration_batches(0)
    assert len(whole) == 4 and whole.group_ids == [0]
    assert sched.next_unit("trainer0").rollout_uid == first.uid  # the whole group trains now, part 0 first
