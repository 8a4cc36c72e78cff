"""Sharded checkpoints with torch.distributed.checkpoint: saved by 2 FSDP2 ranks, resumed by 2
and by 1 with the same weights and optimizer state; a rollout reader takes only model tensors
(only the LoRA ones with LoRA), never optimizer state."""

from __future__ import annotations

import pytest
import torch

from tests.dist_spawn import spawn

pytestmark = pytest.mark.slow


def _model(lora: bool, seed: int):
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from digenrl.adapters.base import seeded
    from digenrl.adapters.flux import TINY_TRANSFORMER

    with seeded(seed):
        model = FluxTransformer2DModel(**TINY_TRANSFORMER)
        if lora:
            model.add_adapter(
                LoraConfig(
                    r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"
                )
            )
        else:
            model.requires_grad_(True)
    return model


def _sharded(lora: bool, seed: int):
    from digenrl.distributed import fsdp

    model = fsdp.parallelize(_model(lora, seed), fsdp.trainer_mesh(), param_dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2)


def _step(model, opt):
    gen = torch.Generator().manual_seed(0)
    b, n, text = 2, 16, 8  # batch, image tokens, text tokens
    out = model(
        hidden_states=torch.randn(b, n, 16, generator=gen),
        encoder_hidden_states=torch.randn(b, text, 32, generator=gen),
        pooled_projections=torch.randn(b, 32, generator=gen),
        timestep=torch.rand(b, generator=gen),
        guidance=torch.full((b,), 3.5),
        img_ids=torch.zeros(n, 3),
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )[0]
    out.square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt) -> dict:
    from digenrl.distributed.fsdp import full_tensors

    weights = dict(full_tensors(model, trainable_only=False))
    moments = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        moments[names[id(p)]] = state["exp_avg"].full_tensor().clone()
    return {"weights": {k: v.clone() for k, v in weights.items()}, "exp_avg": moments}


def _save_and_resume_on_2(rank, world, tmp):
    from digenrl.distributed.dcp import load_sharded, save_sharded

    for lora in (False, True):
        model, opt = _sharded(lora, seed=0)
        _step(model, opt)
        save_sharded(tmp / f"ckpt_lora{lora}", model, opt, trainable_only=lora)
        ref = _snapshot(model, opt)
        fresh, fresh_opt = _sharded(lora, seed=1)  # different init: the load must overwrite it
        _step(fresh, fresh_opt)  # optimizer state exists, and differs, before the load
        load_sharded(tmp / f"ckpt_lora{lora}", fresh, fresh_opt, trainable_only=lora)
        got = _snapshot(fresh, fresh_opt)
        if rank == 0:
            torch.save({"ref": ref, "resumed_on_2": got}, tmp / f"ref_lora{lora}.pt")


def _resume_on_1(rank, world, tmp):
    from digenrl.distributed.dcp import load_sharded

    for lora in (False, True):
        model, opt = _sharded(lora, seed=1)
        _step(model, opt)
        load_sharded(tmp / f"ckpt_lora{lora}", model, opt, trainable_only=lora)
        torch.save(_snapshot(model, opt), tmp / f"resumed_on_1_lora{lora}.pt")


def _assert_same(a: dict, b: dict, keys=None):
    keys = keys or a.keys()
    for k in keys:
        assert torch.equal(a[k], b[k]), k


def test_save_on_2_resume_on_1_and_2_and_rollout_reads_only_weights(tmp_path):
    from digenrl.distributed.dcp import load_model_tensors

    spawn(_save_and_resume_on_2, 2, tmp_path)
    spawn(_resume_on_1, 1, tmp_path)
    for lora in (False, True):
        saved = torch.load(tmp_path / f"ref_lora{lora}.pt")
        ref, on2 = saved["ref"], saved["resumed_on_2"]
        on1 = torch.load(tmp_path / f"resumed_on_1_lora{lora}.pt")
        trained = list(ref["exp_avg"])
        assert trained and (len(trained) < len(ref["weights"])) == lora
        for resumed in (on1, on2):
            # LoRA checkpoints hold only the trained tensors: the frozen base is the pretrained one
            _assert_same(ref["weights"], resumed["weights"], trained if lora else None)
            _assert_same(ref["exp_avg"], resumed["exp_avg"])
        # rollout side: a plain (unsharded) model, no process group, reads only what it needs
        rollout = _model(lora, seed=1)
        wanted = (
            {n: p.data for n, p in rollout.named_parameters() if "lora_" in n}
            if lora
            else dict(rollout.state_dict())
        )
        read = load_model_tensors(tmp_path / f"ckpt_lora{lora}", wanted)
        assert read and all(item.startswith("model.") for item in read)
        assert {item.removeprefix("model.") for item in read} == set(wanted)
        _assert_same(ref["weights"], {n: t for n, t in wanted.items()}, list(wanted))


def test_a_rank_that_cannot_see_the_run_directory_says_so(tmp_path):
    """Shards are written by path: a rank on a node without the run directory refuses with one line
    (before writing anything) instead of writing shards the driver never finds."""
    from digenrl.checkpoint.optimizer import save_optimizer_sharded
    from digenrl.errors import UserError

    hidden = tmp_path / "not-mounted" / "checkpoints" / ".dcp-iter-000001"
    with pytest.raises(
        UserError,
        match=r"^output.run_dir: .*not-mounted/checkpoints is not visible on trainer1's "
        r"node: a sharded trainer group writes its checkpoint shards by path",
    ):
        save_optimizer_sharded(None, hidden, "trainer1's node")
    assert not (tmp_path / "not-mounted").exists()
