"""A model reward on a disaggregated run (issue 23): scored after each unit on the rollout worker's
device (``EngineWorker.score``, beside its next unit), never built on a trainer rank -- read off the
real ``EngineWorker`` build, here as plain objects in this process (tests/test_engine.py runs it on Ray)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine import workers  # noqa: E402
from digenrl.placement.resolve import resolve  # noqa: E402
from digenrl.rewards import FUNCTION_REWARDS, REWARDS, build_reward, scored_after_unit  # noqa: E402
from digenrl.schedule.scheduler import Scheduler  # noqa: E402
from tests.helpers import TINY  # noqa: E402

BASE = [
    *TINY,
    "algorithm.group_size=2",
    "sampling.steps=2",
    "placement.mode=disaggregated",
    "engine.gap=true",
    "engine.tag=true",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    from test_model_rewards import make_tiny_clip

    path = tmp_path_factory.mktemp("clip")
    make_tiny_clip(path)
    return f"reward.components=[{{name: clipscore, args: {{path: {path}}}}}]"


def test_only_model_rewards_of_disaggregated_runs_are_scored_after_the_unit(clip):
    from digenrl.planner.workload import reward_term_kind

    # the runtime and the planner agree on what is a model (one definition, config/train.py)
    assert {k for k in REWARDS if reward_term_kind(k) == "function"} == FUNCTION_REWARDS
    assert scored_after_unit(load_config(None, [*BASE, clip]))
    assert not scored_after_unit(load_config(None, BASE))  # prompt_color: a 2 ms function, inline
    assert not scored_after_unit(load_config(None, [*BASE, clip, "placement.mode=colocated"]))
    assert not scored_after_unit(load_config(None, [*BASE, clip, "reward.service={num_cpus: 0.1}"]))


def test_trainer_ranks_never_build_the_reward_model_and_rollout_workers_score_after_the_unit(
    clip, monkeypatch
):
    cfg = load_config(None, [*BASE, clip])
    layout = resolve(cfg)
    built = []
    monkeypatch.setattr(workers, "build_reward", lambda rc: built.append(rc) or build_reward(rc))
    trainer = workers.EngineWorker(cfg, "trainer0", "trainer", layout=layout)  # a TAG rank: it rolls out
    assert trainer.init_error is None and not trainer.holds_reward() and not built
    rollout = workers.EngineWorker(cfg, "rollout0", "rollout", layout=layout)
    assert rollout.init_error is None and rollout.holds_reward() and len(built) == 1

    sched = Scheduler(layout.scheduler, layout.workers)
    own, tags = sched.next_unit("rollout0"), sched.next_unit("trainer0")
    _, summary = rollout.rollout(own, None)
    assert summary["score_on"] == "rollout0" and "rewards" not in summary  # released, scored after
    assert own.uid in rollout.pending
    _, tag_summary = trainer.rollout(tags, None)
    assert "decoded" in tag_summary and "score_on" not in tag_summary  # a rollout worker scores it

    inline = build_reward(cfg.reward)
    for uid, kept in ((own.uid, None), (tags.uid, tag_summary["decoded"])):
        d = kept or rollout.pending[uid]
        pixels, prompts, metadata = d.pixels, d.prompts, d.metadata
        scored = rollout.score(uid, kept)
        assert scored.end >= scored.start and "clipscore" in scored.timings
        assert scored.total.shape == (2,) and torch.isfinite(scored.total).all()
        torch.testing.assert_close(scored.total, inline(pixels, prompts, metadata)[0])  # as scored inline
    assert not rollout.pending


def test_trainer_rank_evaluates_without_the_reward_model_a_rollout_worker_scores(clip, monkeypatch):
    """In-training eval of a model-reward run: trainer rank 0 samples the eval prompts but never builds
    the reward; it hands back the decoded pixels, a rollout worker's ``score`` scores them, and the
    metrics equal the same evaluation scored inline."""
    from digenrl.run.evaluate import eval_metrics, evaluate_policy

    cfg = load_config(None, [*BASE, clip, "engine.tag=false", "output.eval_every=1"])
    layout = resolve(cfg)
    built = []
    monkeypatch.setattr(workers, "build_reward", lambda rc: built.append(rc) or build_reward(rc))
    trainer = workers.EngineWorker(cfg, "trainer0", "trainer", layout=layout)
    assert trainer.init_error is None
    out = trainer.evaluate()
    assert set(out) == {"eval_decoded"} and not built and not trainer.holds_reward()
    pixels, prompts, metadata = (
        out["eval_decoded"].pixels,
        out["eval_decoded"].prompts,
        out["eval_decoded"].metadata,
    )
    assert pixels.shape[0] == len(prompts) == len(metadata) == len(trainer.prompts.prompts)
    rollout = workers.EngineWorker(cfg, "rollout0", "rollout", layout=layout)
    scored = rollout.score("eval-0", out["eval_decoded"])
    got = eval_metrics(scored.total, scored.parts)
    want = evaluate_policy(trainer.policy, build_reward(cfg.reward), trainer.prompts.prompts).metrics()
    assert set(got) == set(want) == {"eval/clipscore", "eval/reward_mean"}
    assert all(got[k] == pytest.approx(want[k], abs=1e-5) for k in want)
    # a function reward is still scored on the trainer rank itself (no rollout worker call for 2 ms)
    plain = load_config(None, [*BASE, "engine.tag=false", "output.eval_every=1"])
    metrics = workers.EngineWorker(plain, "trainer0", "trainer", layout=resolve(plain)).evaluate()
    assert "eval/reward_mean" in metrics
