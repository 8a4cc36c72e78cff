"""HSDP over 4 gloo ranks (2 replica groups x 2 shards), the way the engine runs it: each replica
group trains its own units -- a different number of passes than the other group -- with backward
reducing only inside the group, then the gradient shards are summed over the replicas before the
step. The update equals the single-process trainer's, and both replicas hold the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.dist_spawn import spawn
from tests.test_fsdp import GRAD_RTOL, WEIGHT_ATOL, _config, _grads, _max_diff, _samples, _trained

pytestmark = pytest.mark.slow


def _hsdp_step(rank, world, out):
    from digenrl.distributed import fsdp
    from digenrl.engine.fsdp_group import rank_slice, select_rows
    from digenrl.policy.model import Policy
    from digenrl.units.train import train_unit

    cfg = _config("flux", True)
    unit = _samples(Policy(cfg, device="cpu", trainable=False), cfg)  # 2 prompt groups x 4 samples
    total = len(unit) * unit.train_idx.shape[1]
    ref = Policy(cfg, device="cpu")
    train_unit(ref, unit, total)
    ref_grads = _grads(ref.adapter.transformer)
    ref.optimizer_step()

    policy = Policy(cfg, device="cpu")
    mesh = fsdp.trainer_mesh(2)  # (replicate 2, shard 2)
    fsdp.shard_policy(policy, mesh, independent_replicas=True)
    net = policy.adapter.transformer
    replica, shard = divmod(rank, 2)
    group = select_rows(unit, torch.arange(4 * replica, 4 * replica + 4))  # replica g trains prompt group g
    if replica == 0:  # as two units of 2 samples: twice the passes of replica 1
        for half in (torch.arange(0, 2), torch.arange(2, 4)):
            train_unit(policy, rank_slice(select_rows(group, half), shard, 2), total)
    else:  # as one unit of 4 samples
        train_unit(policy, rank_slice(group, shard, 2), total)
    buckets = fsdp.all_reduce_replicas(policy.params, mesh)
    grads = _grads(net)
    policy.optimizer_step()
    share = fsdp.local_numel(net, trainable_only=True) / fsdp.full_numel(net, trainable_only=True)
    torch.save(
        {
            "ref": _trained(ref.adapter.transformer, True),
            "ref_grads": ref_grads,
            "grads": grads,
            "weights": _trained(net, True),
            "buckets": buckets,
            "share": share,
        },
        out / f"rank{rank}.pt",
    )


def test_hsdp_replicas_train_apart_and_step_together(tmp_path):
    spawn(_hsdp_step, 4, tmp_path)
    r = [torch.load(tmp_path / f"rank{i}.pt") for i in range(4)]
    scale = max(g.abs().max().item() for g in r[0]["ref_grads"].values())
    assert r[0]["grads"].keys() == r[0]["ref_grads"].keys()
    assert _max_diff(r[0]["grads"], r[0]["ref_grads"]) < GRAD_RTOL * scale
    assert _max_diff(r[0]["weights"], r[0]["ref"]) < WEIGHT_ATOL
    for other in r[1:]:  # every rank of both replicas ends with the same weights
        assert _max_diff(other["weights"], r[0]["weights"]) == 0
    assert all(x["buckets"] >= 1 for x in r)
    assert all(0.4 < x["share"] < 0.6 for x in r)  # each rank holds about half: sharded in its replica
