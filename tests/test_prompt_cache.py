"""Prompt embeddings cached once per run (issue 15, lean workers): each distinct prompt reaches the
text encoder once; the cached conditioning is exactly what encoding again returns."""

from __future__ import annotations

from pathlib import Path

import torch

from digenrl.adapters import build_adapter
from digenrl.config import load_config
from digenrl.policy import Policy
from digenrl.prompts import Prompt
from digenrl.rewards import build_reward
from digenrl.units import rollout_unit


class CountingEncoder:
    """Wraps a tiny preset's text encoder; records every prompt it is asked to encode."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, prompts):
        self.seen.extend(prompts)
        return self.inner(prompts)


def assert_same_cond(a, b):
    assert a.batched.keys() == b.batched.keys() and a.shared.keys() == b.shared.keys()
    for k in a.batched:
        assert torch.equal(a.batched[k], b.batched[k]), k
    for k in a.shared:
        assert torch.equal(a.shared[k], b.shared[k]), k


def test_each_distinct_prompt_is_encoded_once_and_equals_a_fresh_encoding(tiny_cfg):
    wan = load_config(Path(__file__).resolve().parents[1] / "configs" / "wan_tiny.yaml", ["sampling.guidance=3"])
    for cfg in (tiny_cfg(), wan):
        ad = build_adapter(cfg.model, cfg.sampling)
        ad.text = CountingEncoder(ad.text)
        iterations = [["a red apple", "a blue sky"], ["a blue sky", "a cat", "a cat"], ["a red apple", "a cat"]]
        for prompts in iterations:
            cond = ad.cond_for(prompts)
            assert_same_cond(cond, ad.encode_prompts(prompts))  # the reference: encoding again
        fresh_calls = sum(len(p) for p in iterations)  # the reference encodings above
        seen = [p for p in ad.text.seen if p != cfg.sampling.negative_prompt]  # Wan encodes that once itself
        assert sorted(seen[:2]) == ["a blue sky", "a red apple"]  # the first lookup: one batch
        assert ad.prompt_cache.encoded == 3 and len(seen) == 3 + fresh_calls


def test_the_cache_is_bounded_and_can_be_turned_off(tiny_cfg):
    cfg = tiny_cfg("model.prompt_cache=2")
    ad = build_adapter(cfg.model, cfg.sampling)
    for prompts in (["a", "b"], ["c"], ["a"]):  # c evicts a (least recently used), so a is encoded again
        ad.cond_for(prompts)
    assert len(ad.prompt_cache) == 2 and ad.prompt_cache.encoded == 4
    off = build_adapter(tiny_cfg("model.prompt_cache=0").model, cfg.sampling)
    for _ in range(2):
        off.cond_for(["a", "b"])
    assert len(off.prompt_cache) == 0 and off.prompt_cache.encoded == 4


def test_rollouts_encode_a_fixed_prompt_set_once(tiny_cfg):
    overrides = ["model.height=16", "model.width=16", "algorithm.group_size=2", "sampling.steps=2"]
    prompts = [Prompt("a red apple"), Prompt("a blue sky")]
    cached = Policy(tiny_cfg(*overrides), trainable=False)
    uncached = Policy(tiny_cfg(*overrides, "model.prompt_cache=0"), trainable=False)
    reward = build_reward(cached.cfg.reward)
    for it in range(2):
        a = rollout_unit(cached, reward, prompts, [0, 1], it, 0)
        b = rollout_unit(uncached, reward, prompts, [0, 1], it, 0)
        assert_same_cond(a.cond, b.cond)
        assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert cached.adapter.prompt_cache.encoded == 2 and uncached.adapter.prompt_cache.encoded == 4
