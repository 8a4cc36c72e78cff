"""Prompt embeddings cached once per run (lean workers): each distinct prompt reaches the
text encoder once; the cached conditioning is exactly what encoding again returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from digenrl.adapters import build_adapter
from digenrl.config.run import load_config
from digenrl.data.prompts import Prompt
from digenrl.policy.model import Policy
from digenrl.rewards import build_reward
from digenrl.units.rollout import rollout_unit, scored
from tests.helpers import TINY_IMAGE


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
    wan = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "wan_tiny.yaml", ["sampling.guidance=3"]
    )
    for cfg in (tiny_cfg(), wan):
        ad = build_adapter(cfg.model, cfg.sampling)
        ad.text = CountingEncoder(ad.text)
        iterations = [
            ["a red apple", "a blue sky"],
            ["a blue sky", "a cat", "a cat"],
            ["a red apple", "a cat"],
        ]
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
    overrides = [*TINY_IMAGE, "algorithm.group_size=2", "sampling.steps=2"]
    prompts = [Prompt("a red apple"), Prompt("a blue sky")]
    cached = Policy(tiny_cfg(*overrides), trainable=False)
    uncached = Policy(tiny_cfg(*overrides, "model.prompt_cache=0"), trainable=False)
    reward = build_reward(cached.cfg.reward)
    for it in range(2):
        a = scored(rollout_unit(cached, prompts, [0, 1], it, 0), reward)
        b = scored(rollout_unit(uncached, prompts, [0, 1], it, 0), reward)
        assert_same_cond(a.cond, b.cond)
        assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert cached.adapter.prompt_cache.encoded == 2 and uncached.adapter.prompt_cache.encoded == 4


WAN_TINY = Path(__file__).resolve().parents[1] / "configs" / "wan_tiny.yaml"


@pytest.fixture(scope="module")
def wan_checkpoint(tmp_path_factory):
    """A tiny Wan checkpoint in the real layout (UMT5 text encoder + tokenizer), saved with
    save_pretrained."""
    from diffusers import WanPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    cfg = load_config(WAN_TINY, [])
    tiny = build_adapter(cfg.model, cfg.sampling)
    words = ["<pad>", "</s>", "<unk>", "a", "red", "apple", "blue", "sky", "cat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(words),
                d_model=tiny.transformer.config.text_dim,
                d_kv=8,
                d_ff=32,
                num_layers=1,
                num_heads=2,
            )
        )
    path = tmp_path_factory.mktemp("wan_ckpt")
    WanPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        vae=tiny.vae,
        transformer=tiny.transformer,
        scheduler=tiny.flow_scheduler({"shift": 3.0}),
    ).save_pretrained(path)
    return path


def wan_pretrained(path, *overrides):
    cfg = load_config(
        WAN_TINY, [f"model.pretrained={path}", "model.preset=null", "sampling.guidance=3", *overrides]
    )
    return build_adapter(cfg.model, cfg.sampling)


def test_offloaded_text_encoders_are_hooked_and_encode_the_same(wan_checkpoint):
    """On this CPU-only machine the hook's device moves are no-ops: what is tested is that accelerate's
    offload hook is attached to the real UMT5 encoder, that it rests on the CPU, and that the
    conditioning is unchanged; the move to a GPU and back is not exercised here."""
    plain = wan_pretrained(wan_checkpoint)
    lean = wan_pretrained(wan_checkpoint, "model.offload_text_encoders=true")
    assert plain.offload_hooks == [] and not hasattr(plain.pipe.text_encoder, "_hf_hook")
    assert len(lean.offload_hooks) == 1 and lean.offload_hooks[0].model is lean.pipe.text_encoder
    assert type(lean.pipe.text_encoder._hf_hook).__name__ == "CpuOffload"
    prompts = ["a red apple", "a blue sky"]
    assert_same_cond(lean.cond_for(prompts), plain.cond_for(prompts))
    assert {p.device.type for p in lean.pipe.text_encoder.parameters()} == {"cpu"}
    assert lean.cond_for(prompts).batched["prompt_embeds"].abs().sum() > 0  # real, non-trivial embeddings


def test_offloaded_text_encoders_load_straight_to_the_cpu(wan_checkpoint, monkeypatch):
    """``model.offload_text_encoders``: the checkpoint's UMT5 encoder is loaded into host memory and
    never asked to move to the adapter's device (only to the CPU, by the offload hook); the
    transformer and the VAE are. The "meta" device stands in for a GPU on this CPU machine (nothing
    computes on it, and a module moved there could not come back to the CPU)."""
    from transformers import UMT5EncoderModel

    asked, to = [], UMT5EncoderModel.to

    def recording_to(self, *args, **kwargs):
        asked.extend(str(a) for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device)))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(UMT5EncoderModel, "to", recording_to)
    cfg = load_config(
        WAN_TINY,
        [f"model.pretrained={wan_checkpoint}", "model.preset=null", "model.offload_text_encoders=true"],
    )
    lean = build_adapter(cfg.model, cfg.sampling, device="meta")
    assert "meta" not in asked and {p.device.type for p in lean.pipe.text_encoder.parameters()} == {"cpu"}
    assert {p.device.type for p in lean.transformer.parameters()} == {"meta"}
    assert {p.device.type for p in lean.vae.parameters()} == {"meta"}
    assert type(lean.pipe.text_encoder._hf_hook).__name__ == "CpuOffload"
    asked.clear()  # without offloading the encoder goes to the device with the rest
    cfg = load_config(WAN_TINY, [f"model.pretrained={wan_checkpoint}", "model.preset=null"])
    plain = build_adapter(cfg.model, cfg.sampling, device="meta")
    assert "meta" in asked and {p.device.type for p in plain.pipe.text_encoder.parameters()} == {"meta"}


def test_a_lean_rank_loads_the_transformer_alone(wan_checkpoint, monkeypatch):
    """generates=False (a trainer rank that neither encodes nor decodes) reads the checkpoint's
    transformer and scheduler only: the text encoder and the VAE are never constructed."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5EncoderModel

    full = wan_pretrained(wan_checkpoint)
    built = []
    for cls in (UMT5EncoderModel, AutoencoderKLWan):

        def refuse(*args, _cls=cls, **kwargs):
            built.append(_cls.__name__)
            raise AssertionError(f"{_cls.__name__} loaded on a lean rank")

        monkeypatch.setattr(cls, "from_pretrained", refuse)
        monkeypatch.setattr(cls, "__init__", refuse)
    cfg = load_config(WAN_TINY, [f"model.pretrained={wan_checkpoint}", "model.preset=null"])
    lean = build_adapter(cfg.model, cfg.sampling, generates=False)
    assert built == [] and lean.generation_modules() == {} and lean.pipe is None
    ours, theirs = lean.transformer.state_dict(), full.transformer.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert lean.latent_shape() == full.latent_shape() and torch.equal(lean.sigmas(4), full.sigmas(4))
    with pytest.raises(RuntimeError, match="released its VAE"):
        lean.decode(torch.zeros(1, *lean.latent_shape()))


def test_an_engine_trainer_rank_loads_the_transformer_alone(wan_checkpoint):
    from digenrl.engine.workers import EngineWorker
    from digenrl.policy.lora import checksum

    overrides = [
        f"model.pretrained={wan_checkpoint}",
        "model.preset=null",
        "placement.mode=disaggregated",
        "engine.tag=false",
        "train.prompts_per_iteration=2",
        "algorithm.group_size=2",
    ]
    cfg = load_config(WAN_TINY, overrides)
    trainer, rollout = EngineWorker(cfg, "trainer-0", "trainer"), EngineWorker(cfg, "rollout-0", "rollout")
    assert trainer.init_error is None and rollout.init_error is None
    assert trainer.policy.adapter.pipe is None and trainer.policy.adapter.generation_modules() == {}
    assert "pipe.text_encoder" in rollout.policy.adapter.generation_modules()
    assert checksum(trainer.policy.weights()) == checksum(rollout.policy.weights())
