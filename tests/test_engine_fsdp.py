"""FSDP2 trainer ranks in the engine (``train.fsdp: 2``): two gloo trainer ranks shard the tiny
FLUX and train every unit together; on-policy, the run equals the single-process trainer. Its
checkpoints keep the optimizer state sharded (DCP, each rank its own shards) beside the gathered
weights, and resume into 2 sharded ranks, into 1 unsharded rank, and from an unsharded run."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from digenrl.checkpoint.load import load_checkpoint, read_state, read_weights  # noqa: E402
from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.local import LocalTrainer  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from digenrl.policy.model import Policy  # noqa: E402
from tests.helpers import TINY  # noqa: E402

pytestmark = pytest.mark.slow

BASE = [
    *TINY,
    "train.iterations=2",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
    "output.checkpoint_every=1",
]
DISAGG = ["placement.mode=disaggregated", "engine.tag=false", "engine.gap=false"]
FSDP = DISAGG + ["train.fsdp=2", "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]"]
ONE_RANK = DISAGG + ["train.fsdp=off", "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]"]
# the refusals lifted for sharded groups: mini-batch PPO, an EMA (each rank averages its shards), eval
COMBO = ["train.optimizer_steps=2", "train.ema={decay: 0.5, every: 1}", "output.eval_every=1"]
LORA = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The suite's Ray cluster (conftest ``ray_cluster``); its address."""
    return ray_cluster


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The single-process reference and the sharded engine run, 2 iterations, a checkpoint after each."""
    tmp = tmp_path_factory.mktemp("fsdp")
    ref = LocalTrainer(load_config(None, BASE)).run(tmp / "local")
    sharded = run_engine(load_config(None, BASE + FSDP), run_dir=tmp / "fsdp")
    return tmp, ref, sharded


def final(run_dir):
    return load_file(run_dir / "final" / LORA)


def assert_weights_close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=0)


def test_fsdp_trainer_ranks_equal_the_local_trainer(runs):
    tmp, ref, result = runs
    # the same gradient summed in another order (reduce-scatter of two halves); Adam's first
    # steps amplify that near zero, as in test_engine's equality: 1e-4 = 1% of one lr=1e-2 step
    assert_weights_close(final(tmp / "fsdp"), final(tmp / "local"), atol=1e-4)
    for mine, theirs in zip(result.metrics, ref.metrics):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
        assert mine["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
    # rank 0 trains for the group: each unit trained once, each step once per iteration
    tl = Timeline.from_chrome_trace(tmp / "fsdp" / "timeline.json")
    assert {t.worker for t in tl.of("train")} == {"trainer0"} and len(tl.of("step")) == 2
    # weights went by broadcast (engine.weight_sync: auto), streamed from the gathered shards, and the
    # rollout worker loaded exactly what rank 0 sent (keys and per-tensor fingerprints)
    sent = {e.version: e.args for e in tl.of("sync") if e.args["direction"] == "publish"}
    loaded = [e for e in tl.of("sync") if e.args["direction"] == "fetch"]
    assert sorted(sent) == [1, 2] and {a["transport"] for a in sent.values()} == {"broadcast"}
    assert loaded and all(e.args["digest"] == sent[e.version]["digest"] for e in loaded)


def test_sharded_checkpoint_keeps_the_optimizer_state_sharded(runs):
    tmp, _, _ = runs
    ckpt, local_ckpt = (tmp / run / "checkpoints" / "iter-000002" for run in ("fsdp", "local"))
    # the weights gathered, in the ordinary format (eval, rollout workers and diffusers read it)
    assert read_weights(ckpt, True).keys() == read_weights(local_ckpt, True).keys()
    # the optimizer state in DCP format: each rank wrote its own shard file, about half of it, none gathered
    state = read_state(ckpt)
    assert state.optimizer_format == "dcp" and not (ckpt / "optimizer.pt").exists()
    shards = {n: size for n, size in state.files.items() if n.startswith("dcp/__")}
    assert sorted(shards) == ["dcp/__0_0.distcp", "dcp/__1_0.distcp"] and "dcp/.metadata" in state.files
    assert all(0.25 < size / sum(shards.values()) < 0.75 for size in shards.values()), shards
    assert not list((tmp / "fsdp" / "checkpoints").glob(".dcp-*"))  # every staged shard directory moved in
    # an unsharded policy, in a process without a process group, loads it (DCP reshards to one rank)
    policy = Policy(load_config(None, BASE), device="cpu")
    assert load_checkpoint(ckpt, policy, rng=False).version == 2
    local = torch.load(local_ckpt / "optimizer.pt", weights_only=False)["state"]
    assert len(local) == len(policy.params)
    for i, p in enumerate(policy.params):
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                policy.optimizer.state[p][moment], local[i][moment], atol=1e-6, rtol=1e-3
            )


def test_resume_a_sharded_run_into_two_sharded_ranks(runs):
    tmp, _, uninterrupted = runs
    cfg = load_config(None, BASE + FSDP)
    result = run_engine(cfg, run_dir=tmp / "resume2", resume=tmp / "fsdp" / "checkpoints" / "iter-000001")
    # the same group reloading its own shards: the second iteration exactly as without the stop
    assert_weights_close(final(tmp / "resume2"), final(tmp / "fsdp"), atol=1e-7)
    assert result.metrics[-1]["grad_norm"] == pytest.approx(uninterrupted.metrics[-1]["grad_norm"], rel=1e-6)
    assert read_state(tmp / "resume2" / "checkpoints" / "iter-000002").optimizer_format == "dcp"


def test_resume_a_sharded_run_into_one_unsharded_rank(runs):
    tmp, ref, _ = runs
    result = run_engine(
        load_config(None, BASE + ONE_RANK),
        run_dir=tmp / "resume1",
        resume=tmp / "fsdp" / "checkpoints" / "iter-000001",
    )
    assert_weights_close(final(tmp / "resume1"), final(tmp / "fsdp"), atol=1e-4)
    assert_weights_close(final(tmp / "resume1"), final(tmp / "local"), atol=1e-4)
    assert result.metrics[-1]["grad_norm"] == pytest.approx(ref.metrics[-1]["grad_norm"], rel=1e-5)
    assert read_state(tmp / "resume1" / "checkpoints" / "iter-000002").optimizer_format == "torch"


def test_resume_an_unsharded_run_into_sharded_ranks(runs):
    tmp, ref, _ = runs
    result = run_engine(
        load_config(None, BASE + FSDP),
        run_dir=tmp / "unsharded_to_2",
        resume=tmp / "local" / "checkpoints" / "iter-000001",
    )
    assert_weights_close(final(tmp / "unsharded_to_2"), final(tmp / "local"), atol=1e-4)
    assert result.metrics[-1]["grad_norm"] == pytest.approx(ref.metrics[-1]["grad_norm"], rel=1e-5)


def test_minibatches_ema_and_eval_on_sharded_ranks_equal_the_local_trainer(cluster, tmp_path):
    ref = LocalTrainer(load_config(None, BASE + COMBO)).run(tmp_path / "local")
    result = run_engine(load_config(None, BASE + COMBO + FSDP), run_dir=tmp_path / "fsdp")
    # final/ holds the EMA weights; the checkpoint keeps the average, gathered
    assert_weights_close(final(tmp_path / "fsdp"), final(tmp_path / "local"), atol=1e-4)
    ema = [
        load_file(tmp_path / run / "checkpoints" / "iter-000002" / "ema.safetensors")
        for run in ("fsdp", "local")
    ]
    assert_weights_close(*ema, atol=1e-4)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        evals = {k for k in theirs if k.startswith("eval/")}
        assert evals and evals == {k for k in mine if k.startswith("eval/")}
        for k in evals:  # every rank sampled the eval with the EMA weights; rank 0 reports it
            assert mine[k] == pytest.approx(theirs[k], abs=1e-4)
    tl = Timeline.from_chrome_trace(tmp_path / "fsdp" / "timeline.json")
    assert len(tl.of("step")) == 4  # two optimizer steps per iteration
