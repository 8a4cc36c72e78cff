"""A sharded group's unit split, as pure functions (engine/fsdp_group.py): a unit generated in shares
and merged back is the unit, every per-sample field of it (the FSDP x2 + TAG hang: a merge that
dropped ``step_noise`` left a follower's share of the unit out of range, its lead waiting in an
all-gather); every rank runs the same passes (lockstep), also over uneven shares."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from digenrl.adapters.cond import Cond
from digenrl.engine.fsdp_group import lockstep_steps, merge_shares, select_rows, share_rows, unit_share
from digenrl.rewards.base import Decoded
from digenrl.units.samples import ROW_FIELDS, Samples
from digenrl.units.types import RolloutUnit

#: the fields of Samples that are not one tensor row per sample (prompts, cond and reward_parts are
#: per sample too, cut and joined by name)
NOT_ROWS = {"iteration", "version", "group_ids", "sigmas", "sde_mask", "preview", "timings", "first_sample"}
BY_NAME = {"prompts", "cond", "reward_parts"}


def unit_samples(groups: list[int], per_group: int, first: int = 0) -> Samples:
    """A unit's samples with every per-sample field set to distinct values (row i holds i)."""
    n, steps = len(groups) * per_group, 3
    rows = torch.arange(n, dtype=torch.float32)
    return Samples(
        iteration=1,
        version=1,
        group_ids=list(groups),
        prompts=[f"p{i}" for i in range(n)],
        cond=Cond({"emb": rows.view(n, 1).repeat(1, 2)}, {"ids": torch.zeros(2)}),
        latents=rows.view(n, 1, 1).repeat(1, steps + 1, 2),
        log_probs=rows.view(n, 1).repeat(1, steps),
        sigmas=torch.linspace(1, 0, steps + 1),
        sde_mask=torch.ones(steps, dtype=torch.bool),
        train_idx=(torch.arange(n) % steps).view(n, 1),
        rewards=rows.clone(),
        reward_parts={"a": rows * 2},
        advantages=rows * 3,
        first_sample=first,
        noise_seeds=torch.arange(n).view(n, 1),
        step_noise=rows.view(n, 1, 1).repeat(1, steps, 2),
    )


def test_every_field_of_samples_is_cut_and_joined_or_is_per_unit():
    """A per-sample field added to Samples must join ROW_FIELDS, or a split unit loses it."""
    names = {f.name for f in dataclasses.fields(Samples)}
    assert names == set(ROW_FIELDS) | BY_NAME | NOT_ROWS


@pytest.mark.parametrize(
    "groups, span",
    [((0, 1), (0, 4)), ((3,), (0, 4)), ((2,), (2, 4))],
    ids=["whole_groups", "slices_of_one_group", "a_sub_group_unit"],
)
def test_a_unit_generated_in_shares_merges_back_into_the_unit(groups, span):
    G = 4
    unit = RolloutUnit(uid="rollout-1-0", iteration=1, index=0, groups=groups, version=1)
    if span != (0, G):
        unit = dataclasses.replace(unit, part=span[0] // (span[1] - span[0]), parts=G // (span[1] - span[0]))
    assert unit.sample_range(G) == span
    whole = unit_samples(list(groups), span[1] - span[0], span[0])
    parts = []
    for share in range(2):  # what each rank generates: its groups, or its slice of every group
        g, (lo, hi) = unit_share(unit.groups, span, share, 2)
        w = span[1] - span[0]  # each group's samples in the unit
        rows = torch.tensor([groups.index(k) * w + j - span[0] for k in g for j in range(lo, hi)])
        mine = dataclasses.replace(select_rows(whole, rows), group_ids=list(g), first_sample=lo)
        decoded = Decoded(whole.latents[rows, 0], mine.prompts, [{"row": i} for i in rows.tolist()])
        parts.append((mine, decoded))
    merged, decoded = merge_shares(parts, unit, G)
    for f in ROW_FIELDS:
        torch.testing.assert_close(getattr(merged, f), getattr(whole, f), msg=f)
    assert merged.prompts == whole.prompts and merged.group_ids == list(groups)
    torch.testing.assert_close(merged.cond.batched["emb"], whole.cond.batched["emb"])
    torch.testing.assert_close(merged.reward_parts["a"], whole.reward_parts["a"])
    torch.testing.assert_close(decoded.pixels, whole.latents[:, 0])
    assert decoded.prompts == whole.prompts and [m["row"] for m in decoded.metadata] == list(
        range(len(whole))
    )


def test_uneven_shares_run_the_same_passes_on_every_rank():
    """3 samples over 2 ranks (2 + 1) at micro-batch 1: both ranks run two micro-batches, at the union
    of the steps their samples train (the rank with one sample runs the second zero-weighted)."""
    samples = unit_samples([0], 3)
    shares = [samples.train_idx[share_rows(samples, r, 2)] for r in range(2)]
    assert [len(s) for s in shares] == [1, 2]  # as equal as they split
    steps = lockstep_steps(shares, micro_batch=1, tsp_rank=0, tsp_degree=1)
    assert steps == [[0, 1], [2]]
