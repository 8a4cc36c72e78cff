"""Activation checkpointing per transformer block: the same gradients, and autograd keeps only
each block's inputs (counted with saved-tensor hooks) -- on tiny configs of the real classes."""

from __future__ import annotations

import copy

import pytest
import torch

from digenrl.adapters.base import seeded
from digenrl.distributed.blocks import transformer_blocks
from digenrl.distributed.checkpointing import checkpoint_blocks, is_checkpointed


def _flux():
    from diffusers import FluxTransformer2DModel

    from digenrl.adapters.flux import TINY_TRANSFORMER

    with seeded(0):
        model = FluxTransformer2DModel(**TINY_TRANSFORMER)
    b, n, text = 2, 16, 8  # batch, image tokens, text tokens
    inputs = dict(
        hidden_states=torch.randn(b, n, 16),
        encoder_hidden_states=torch.randn(b, text, 32),
        pooled_projections=torch.randn(b, 32),
        timestep=torch.rand(b),
        guidance=torch.full((b,), 3.5),
        img_ids=torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1
        ).reshape(n, 3),
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )
    return model, inputs


def _wan():
    from diffusers import WanTransformer3DModel

    from digenrl.adapters.wan import TINY_TRANSFORMER

    with seeded(0):
        model = WanTransformer3DModel(**TINY_TRANSFORMER)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 2, 8, 8),
        encoder_hidden_states=torch.randn(2, 8, 16),
        timestep=torch.rand(2) * 1000,
        return_dict=False,
    )
    return model, inputs


def _loss(model, inputs):
    out = model(**inputs)[0]
    return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()


class SavedBytes:
    """Bytes autograd saves for backward while each block's forward runs (one count per storage)."""

    def __init__(self, model):
        self.per_block: dict[int, int] = {}
        self.inputs: dict[int, int] = {}  # the block's tensor arguments (not those inside tuples)
        self._current, self._seen = None, set()
        self.handles = []
        for i, block in enumerate(transformer_blocks(model)):
            self.handles.append(block.register_forward_pre_hook(self._enter(i), with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._leave))

    def _enter(self, i):
        def hook(module, args, kwargs):
            self._current, self._seen = i, set()
            tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
            self.inputs[i] = sum(
                t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values()
            )

        return hook

    def _leave(self, module, args, output):
        self._current = None

    def pack(self, t):
        if self._current is not None:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in self._seen:
                self._seen.add(key)
                self.per_block[self._current] = self.per_block.get(self._current, 0) + key[1]
        return t


def _measure(model, inputs):
    counter = SavedBytes(model)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        loss = _loss(model, inputs)
    loss.backward()
    for h in counter.handles:
        h.remove()
    return counter, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", [_flux, _wan], ids=["flux", "wan"])
def test_checkpointing_keeps_gradients_and_only_block_inputs(family):
    model, inputs = family()
    ckpt = copy.deepcopy(model)
    assert checkpoint_blocks(ckpt) == len(transformer_blocks(ckpt)) and is_checkpointed(ckpt)
    assert checkpoint_blocks(ckpt) == 0  # idempotent
    assert list(ckpt.state_dict()) == list(model.state_dict())  # names unchanged
    plain, grads = _measure(model, inputs)
    checked, ckpt_grads = _measure(ckpt, inputs)
    assert set(grads) == set(ckpt_grads) and grads
    for name in grads:
        torch.testing.assert_close(ckpt_grads[name], grads[name], rtol=0, atol=1e-7, msg=name)
    for i in plain.per_block:
        # checkpointed: exactly the block's tensor inputs (shared rotary tables, computed once
        # per forward, stay referenced); plain: many times more
        assert checked.per_block[i] == checked.inputs[i], (i, checked.per_block, checked.inputs)
        assert plain.per_block[i] > 10 * checked.inputs[i], (i, plain.per_block, checked.inputs)


def test_config_switch_checkpoints_the_trained_policy(tiny_cfg):
    from digenrl.policy.model import Policy

    assert not is_checkpointed(Policy(tiny_cfg(), device="cpu").adapter.transformer)  # auto = off for now
    on = Policy(tiny_cfg("train.activation_checkpointing=on"), device="cpu")
    assert is_checkpointed(on.adapter.transformer)
    rollout_only = Policy(tiny_cfg("train.activation_checkpointing=on"), device="cpu", trainable=False)
    assert not is_checkpointed(rollout_only.adapter.transformer)  # nothing to recompute when sampling


@pytest.mark.parametrize("family", ["flux", "wan", "hunyuan", "qwen"])
def test_every_family_through_its_adapter(family):
    """Each family's block lists are found and checkpointing keeps the adapter's gradients (full
    fine-tuning, the adapter's real forward inputs, CFG included where the family uses it)."""
    from pathlib import Path

    from digenrl.adapters import build_adapter
    from digenrl.config.run import load_config

    cfg = load_config(Path(__file__).parents[1] / "configs" / f"{family}_tiny.yaml", ["model.lora=null"])
    grads = []
    for ckpt in (False, True):
        ad = build_adapter(cfg.model, cfg.sampling, "cpu")
        net = ad.transformer.requires_grad_(True)
        n_blocks = len(transformer_blocks(net))
        layers = net.config.num_layers + getattr(net.config, "num_single_layers", 0)
        assert n_blocks == layers > 0
        if ckpt:
            checkpoint_blocks(net)
        cond = ad.encode_prompts(["a red cube", "a blue ball"])
        x = torch.randn((2, *ad.latent_shape()), generator=torch.Generator().manual_seed(0))
        v = ad.velocity(x, torch.tensor([0.7, 0.3]), cond)
        (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
        grads.append({n: p.grad for n, p in net.named_parameters() if p.grad is not None})
    assert grads[0] and set(grads[0]) == set(grads[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6, msg=name)
