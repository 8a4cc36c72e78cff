"""``engine.compile_rollout``: the rollout workers' transformer under ``torch.compile``. Equality with
eager on CPU only (no CUDA graphs here, and no speed claim: on this 2-core CPU compiled sampling
measured slower than eager; its speed is the GPU check's, benchmarks/gpu_smoke.sh)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from digenrl.config.run import load_config  # noqa: E402
from digenrl.data.prompts import PromptSampler, load_prompts  # noqa: E402
from digenrl.engine.workers import EngineWorker  # noqa: E402
from digenrl.policy.model import Policy, compile_transformer  # noqa: E402
from digenrl.rewards import build_reward  # noqa: E402
from digenrl.units.rollout import rollout_unit, scored  # noqa: E402
from tests.helpers import FULL_MODE, TINY  # noqa: E402

SMALL = [
    *FULL_MODE,
    *TINY,
    "algorithm.group_size=2",
    "sampling.steps=2",
    "train.prompts_per_iteration=1",
    "engine.tag=false",
    "engine.compile_rollout=on",
]
#: compiled vs eager, fp32 on CPU: inductor fuses and reorders the reductions, so not bit for bit
ATOL = 1e-5


def test_only_rollout_workers_compile():
    cfg = load_config(None, SMALL)
    assert EngineWorker(cfg, "rollout0", "rollout").resolved()["compiled"]
    assert not EngineWorker(cfg, "trainer0", "trainer").resolved()["compiled"]
    assert load_config(None, SMALL + ["engine.compile_rollout=off"]).engine.compile_rollout == "off"


@pytest.mark.slow
def test_a_compiled_transformer_samples_what_the_eager_one_does(monkeypatch):
    from torch._inductor import config as inductor

    # inductor compiles its C++ kernels in this process: its pool of compile workers (each importing
    # torch) cost ~4 s more CPU on these 2 cores than it saved (cold cache, /usr/bin/time); and scalar
    # kernels: vectorized ones took ~4 s more CPU to generate and compile (40.5 s against 36.1 s), and
    # what is checked here is the compiled module's plumbing and numerics, not the CPU kernels' speed
    monkeypatch.setattr(inductor, "compile_threads", 1)
    monkeypatch.setattr(inductor.cpp, "simdlen", 1)
    cfg = load_config(None, SMALL)
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(0, 1)
    reward = build_reward(cfg.reward)
    out = []
    for compiled in (False, True):
        torch.manual_seed(cfg.train.seed)  # the same initial weights (the preset's random init)
        policy = Policy(cfg, trainable=False)
        if compiled:
            compile_transformer(policy)
        out.append(scored(rollout_unit(policy, prompts, [0], 0, cfg.train.seed), reward))
    eager, compiled = out
    torch.testing.assert_close(compiled.latents, eager.latents, atol=ATOL, rtol=0)
    torch.testing.assert_close(compiled.log_probs, eager.log_probs, atol=ATOL, rtol=0)
