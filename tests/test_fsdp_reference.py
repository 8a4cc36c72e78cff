"""A rank that the layout shards creates its KL reference and EMA on its shards (issue 36, item 4):
nothing full-size exists after construction, and after a step the reference forward and the EMA equal
those of the same policy kept whole in one process (2 gloo ranks, the tiny FLUX, full fine-tuning)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from tests.dist_spawn import spawn
from tests.helpers import TINY_IMAGE

pytestmark = pytest.mark.slow

SETS = [*TINY_IMAGE, "model.lora=null", "algorithm.kl_beta=0.1", "train.lr=1e-2", "train.ema={decay: 0.5}"]


def _step(policy, x, sigma, cond, share=1.0):
    """One step on the same batch; ``share``: each rank's part of the loss (FSDP sums the gradients)."""
    (share * policy.adapter.velocity(x, sigma, cond).square().mean()).backward()
    policy.optimizer_step()


def _check(rank, world, out):
    from digenrl.config.run import load_config
    from digenrl.engine.fsdp_group import shard_trainer_rank
    from digenrl.placement.layout import RunLayout
    from digenrl.policy.model import Policy
    from digenrl.policy.settings import single_process_settings

    cfg = load_config("configs/flux_tiny.yaml", SETS)
    torch.manual_seed(0)
    whole = Policy(cfg, device="cpu")
    layout = mock.create_autospec(RunLayout, instance=True)
    layout.settings = dataclasses.replace(single_process_settings(cfg), fsdp=world)
    layout.will_shard.side_effect = lambda role: role != "rollout"
    torch.manual_seed(0)
    policy = Policy(cfg, device="cpu", layout=layout)
    built = {"ref": policy._ref, "ema": policy.ema, "pending": policy.shard_pending}
    shard_trainer_rank(policy, world)
    cond = policy.adapter.encode_prompts(["a red cube", "a blue ball"])
    x = torch.randn((2, *policy.adapter.latent_shape()), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.7, 0.3])
    _step(whole, x, sigma, cond)
    _step(policy, x, sigma, cond, share=1 / world)
    result = {"built": built, "ref_kinds": {type(v).__name__ for v in policy._ref.values()}}
    with torch.no_grad():
        for name, p in (("whole", whole), ("sharded", policy)):
            result[name] = p.adapter.velocity(x, sigma, cond)
            with p.reference():
                result[name + "_ref"] = p.adapter.velocity(x, sigma, cond)
            result[name + "_ema"] = p.ema.state()
        result["after"] = policy.adapter.velocity(x, sigma, cond)  # the swap put the weights back
    torch.save(result, out / f"rank{rank}.pt")


def test_sharded_reference_and_ema_equal_the_whole_policy(tmp_path):
    spawn(_check, 2, tmp_path)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["built"] == {"ref": None, "ema": None, "pending": True}  # nothing built before sharding
        assert r["ref_kinds"] == {"DTensor"}  # the reference is this rank's shards
        moved = (r["whole"] - r["whole_ref"]).abs().max().item()
        assert moved > 1e-3, "the step must move the weights away from the reference"
        torch.testing.assert_close(r["sharded_ref"], r["whole_ref"], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["sharded"], r["whole"], atol=1e-5, rtol=0)
        assert torch.equal(r["after"], r["sharded"])
        assert r["sharded_ema"].keys() == r["whole_ema"].keys()
        for k, v in r["whole_ema"].items():
            # weights after Adam's first step: elements whose gradient is near eps move by another
            # fraction of lr under another summation order (tests/test_fsdp.py): 1e-2 * lr
            torch.testing.assert_close(r["sharded_ema"][k], v, atol=1e-4, rtol=0)
