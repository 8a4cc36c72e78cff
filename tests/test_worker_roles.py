"""Lean workers: what each engine role holds, read off the real ``EngineWorker`` build
(the same class the Ray actors run, here as a plain object in this process)."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.worker_setup import ResumeFrom, generates
from digenrl.engine.workers import EngineWorker
from digenrl.units.rollout import rollout_unit, scored  # noqa: E402
from digenrl.units.train import train_unit
from tests.helpers import FULL_MODE, TINY  # noqa: E402

BASE = [
    *TINY,
    "algorithm.group_size=2",
    "sampling.steps=2",
    *FULL_MODE,
    "engine.tag=false",
]
FULL_FT_KL = ["model.lora=null", "algorithm.kl_beta=0.04"]


def parameter_count(modules: dict) -> int:
    return sum(p.numel() for m in modules.values() if isinstance(m, torch.nn.Module) for p in m.parameters())


def test_a_trainer_rank_holds_no_text_encoder_and_no_vae():
    trainer = EngineWorker(load_config(None, BASE), "trainer-0", "trainer")
    rollout = EngineWorker(load_config(None, BASE), "rollout-0", "rollout")
    assert trainer.init_error is None and rollout.init_error is None
    assert trainer.policy.adapter.generation_modules() == {}
    held = rollout.policy.adapter.generation_modules()
    assert {"vae", "text"} <= held.keys() and parameter_count(held) > 0  # the VAE's parameters
    # the lean rank trains on the rollout worker's samples exactly as a full one does
    full = EngineWorker(load_config(None, BASE + ["output.eval_every=1"]), "trainer-1", "trainer")
    assert full.policy.adapter.generation_modules().keys() == held.keys()  # it evaluates: keeps them
    prompts = rollout.prompts.for_iteration(0, 2)
    samples = scored(rollout_unit(rollout.policy, prompts, [0, 1], 0, 0), rollout.reward)
    samples.advantages = torch.linspace(-1, 1, len(samples))
    total = len(samples) * samples.train_idx.shape[1]
    for worker in (trainer, full):
        train_unit(worker.policy, samples, total)
    for a, b in zip(trainer.policy.params, full.policy.params):
        assert a.grad is not None and torch.equal(a.grad, b.grad)


def test_generation_roles():
    cfg = load_config(None, BASE)
    assert generates(cfg, "rollout") and generates(cfg, "both") and not generates(cfg, "trainer")
    assert generates(load_config(None, BASE + ["engine.tag=true"]), "trainer")


def test_a_rollout_worker_holds_no_optimizer_and_no_reference_copy():
    rollout = EngineWorker(load_config(None, BASE + FULL_FT_KL), "rollout-0", "rollout")
    trainer = EngineWorker(load_config(None, BASE + FULL_FT_KL), "trainer-0", "trainer")
    assert rollout.init_error is None and trainer.init_error is None
    assert rollout.policy.optimizer is None and rollout.policy._ref is None
    # the trainer rank of the same full fine-tune with KL does hold both
    assert trainer.policy.optimizer is not None and trainer.policy._ref is not None
    net_params = sum(p.numel() for p in trainer.policy.adapter.transformer.parameters())
    assert sum(p.numel() for p in trainer.policy._ref.parameters()) == net_params


def test_rollout_workers_resume_by_path_without_the_optimizer_state(tmp_path):
    """Checkpoints by path: a rollout worker loads weights and version from the checkpoint
    directory and never opens ``optimizer.pt`` (here deleted); a trainer rank needs it."""
    from digenrl.checkpoint.compat import CheckpointError
    from digenrl.checkpoint.store import checkpoint_files, save_checkpoint_files

    cfg = load_config(None, BASE)
    source = EngineWorker(cfg, "trainer-0", "trainer")
    with torch.no_grad():
        for p in source.policy.params:
            p.add_(0.01)
    source.policy.version = 1
    ckpt = save_checkpoint_files(tmp_path, 1, checkpoint_files(source.policy, 1, cfg, {}))
    (ckpt / "optimizer.pt").unlink()
    resume = ResumeFrom(str(ckpt), rollout_files=None)  # the object-store copy is not needed here
    rollout = EngineWorker(cfg, "rollout-0", "rollout", resume=resume)
    assert rollout.init_error is None and rollout.policy.version == 1
    want = source.policy.weights()
    got = rollout.policy.weights()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].to(got[k].dtype)) for k in want)
    trainer = EngineWorker(cfg, "trainer-1", "trainer", resume=resume)
    assert isinstance(trainer.init_error, CheckpointError) and "optimizer.pt" in str(trainer.init_error)


def test_a_trainer_rank_that_cannot_see_the_checkpoint_says_so(tmp_path):
    missing = tmp_path / "elsewhere" / "iter-000001"
    trainer = EngineWorker(
        load_config(None, BASE), "trainer-0", "trainer", resume=ResumeFrom(str(missing), None)
    )
    assert str(trainer.init_error) == (
        f"--resume: {missing} is not visible on trainer-0's node: trainer ranks read "
        "the checkpoint directory by path (put the run directory where every node "
        "mounts it)"
    )
