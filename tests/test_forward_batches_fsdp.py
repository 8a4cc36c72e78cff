"""Ratio discipline under FSDP (issue 36, item 7): a rollout worker's forward batches are exactly the
forwards each FSDP trainer rank recomputes -- per rank, its share of every mini-batch
(``engine.fsdp_group.share_rows``) cut into ``train.micro_batch`` chunks, and per chunk the samples that
train the step. A different batch changes the GPU kernels and so the log-prob (a ratio != 1). On
849bed7 the rollout cut micro-batches over the whole unit: with 6 samples, micro-batch 4 and 2 ranks
its forward of rows 0-3 matches neither rank's (0-2, 3-5)."""

from __future__ import annotations

import pytest
import torch

from digenrl.config.run import load_config
from digenrl.engine.fsdp_group import share_rows
from digenrl.units.rollout import forward_batches
from tests.helpers import TINY


class _Unit:
    """What ``share_rows`` reads of a unit's samples."""

    def __init__(self, n: int, groups: int, first: int = 0):
        self.n, self.group_ids, self.first_sample = n, list(range(groups)), first

    def __len__(self):
        return self.n


def trainer_forwards(train_idx, cfg, shards: int, groups: int) -> list[set[tuple[int, ...]]]:
    """Per step, the rows of every forward the FSDP ranks run (TSP 1), as the trainer cuts them."""
    n, S, steps = len(train_idx), cfg.train.optimizer_steps, cfg.sampling.steps
    per_step = [set() for _ in range(steps)]
    for s in range(S):
        for r in range(shards):
            own = share_rows(_Unit(n, groups), r, shards, s, S, cfg.algorithm.group_size)
            for mb in own.split(cfg.train.micro_batch):  # train_unit on the share: micro-batches of it
                for i in range(steps):
                    rows = mb[(train_idx[mb] == i).any(1)]
                    if len(rows):
                        per_step[i].add(tuple(rows.tolist()))
    return per_step


@pytest.mark.parametrize(
    "group_size,groups,micro_batch,minibatches,shards",
    [(6, 1, 4, 1, 2), (3, 2, 4, 1, 2), (8, 2, 3, 2, 2), (4, 3, 5, 1, 4), (4, 2, 2, 1, 2)],
)
def test_rollout_forwards_are_each_ranks_train_forwards(group_size, groups, micro_batch, minibatches, shards):
    cfg = load_config(
        None,
        [
            *TINY,
            "placement.mode=disaggregated",
            "engine.tsp_degree=1",
            f"algorithm.group_size={group_size}",
            f"train.prompts_per_iteration={groups}",
            f"train.micro_batch={micro_batch}",
            f"train.optimizer_steps={minibatches}",
        ],
    )
    n = group_size * groups
    train_idx = torch.randint(0, cfg.sampling.steps, (n, 2), generator=torch.Generator().manual_seed(n))
    want = trainer_forwards(train_idx, cfg, shards, groups)
    got = forward_batches(train_idx, cfg, group_size, 0, shards)
    assert got is not None
    for i, batches in enumerate(got):
        rows = [tuple(b.tolist()) for b in batches]
        assert sorted(sum(rows, ())) == list(range(n)), "each sample in exactly one forward per step"
        assert want[i] <= set(rows), (
            f"step {i}: the trainer's forwards {want[i]} are not the rollout's {rows}"
        )
    unit_wide = forward_batches(train_idx, cfg, group_size, 0)  # the cut before: over the whole unit
    if n // shards % micro_batch and unit_wide is not None:
        assert any(not want[i] <= {tuple(b.tolist()) for b in bs} for i, bs in enumerate(unit_wide))
