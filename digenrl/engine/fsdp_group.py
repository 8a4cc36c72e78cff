"""A sharded (FSDP2) trainer group's unit split: each rank trains an equal share of a unit's
samples (of one mini-batch's samples, with mini-batch PPO), so every rank runs the same forward /
backward passes, and rank 0 reports the unit's stats combined over the ranks (docs/distributed.md)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from digenrl.adapters.cond import Cond
from digenrl.checkpoint.load import read_safetensors, read_state
from digenrl.checkpoint.optimizer import restore_optimizer
from digenrl.checkpoint.store import EMA_FILE, OLD_POLICY_FILE, STATE_FILE, find_checkpoint
from digenrl.distributed import fsdp
from digenrl.rewards.base import Decoded
from digenrl.units.rollout import _timestep_selection, forward_batches, rollout_unit
from digenrl.units.rows import minibatch_rows
from digenrl.units.samples import ROW_FIELDS, Samples
from digenrl.units.train import train_unit


def shard_trainer_rank(policy, degree: int, resume: str | None = None):
    """Shard a trainer rank's policy (FSDP2 over groups of ``degree`` consecutive ranks of the group
    just joined -- HSDP when there are several: each replica group trains its own units, backward
    reduce-scatters inside it only, :func:`~digenrl.distributed.fsdp.all_reduce_replicas` sums over the
    replicas at the step; activation checkpointing, if on, is already applied by ``Policy``), then
    restore a resumed run's optimizer state (checkpoint ``resume``) into the shards: a ``dcp/``
    checkpoint resharded (each rank reads its own shards, by path), or an unsharded run's
    ``optimizer.pt`` split; its EMA and old policy too (created on the shards, so loaded only now).
    Returns the device mesh."""
    import json
    from pathlib import Path

    mesh = fsdp.trainer_mesh(degree, policy.device.type)
    fsdp.shard_policy(policy, mesh, independent_replicas=True)
    if resume is not None:
        state = read_state(find_checkpoint(Path(resume)))
        restore_optimizer(state, policy)
        raw = json.loads((state.path / STATE_FILE).read_text())
        if policy.ema is not None and EMA_FILE in state.files:  # else: restarted from these weights
            policy.ema.load(read_safetensors(state.path / EMA_FILE), int(raw.get("ema", {}).get("steps", 0)))
        if policy.old is not None:  # diffusion_nft, as checkpoint.store.load_checkpoint does
            steps = state.iteration * policy.cfg.train.optimizer_steps
            if OLD_POLICY_FILE in state.files:
                policy.old.load(read_safetensors(state.path / OLD_POLICY_FILE), steps)
            else:
                policy.old.reset(steps)
    return mesh


def share_rows(
    samples: Samples,
    rank: int,
    world: int,
    minibatch: int = 0,
    minibatches: int = 1,
    group_size: int | None = None,
) -> torch.Tensor:
    """The rows of rank ``rank``'s equal share (consecutive rows) of the unit's samples of mini-batch
    ``minibatch`` (:func:`~digenrl.units.rows.minibatch_rows`; all of them with one mini-batch)."""
    n = len(samples)
    rows = torch.arange(n)
    if minibatches > 1:
        rows = minibatch_rows(
            n, group_size, minibatch, minibatches, n // len(samples.group_ids), samples.first_sample
        )
    lo, hi = len(rows) * rank // world, len(rows) * (rank + 1) // world  # as equal as they split
    return rows[lo:hi]


def rank_slice(samples: Samples, rank: int, world: int, *args) -> Samples:
    """Rank ``rank``'s share (:func:`share_rows`) of the unit's samples. Train it as a whole:
    ``train_unit(..., minibatch=0, minibatches=1)``."""
    return select_rows(samples, share_rows(samples, rank, world, *args))


def train_share(policy, samples: Samples, unit, rank: int, degree: int, total_terms: int) -> dict:
    """Rank ``rank`` of a shard group of ``degree`` trains its share (:func:`rank_slice`) of train unit
    ``unit`` (its mini-batch ``unit.step``; its TSP positions), in lockstep with the group's other
    ranks (:func:`lockstep_steps`); returns the share's stats."""

    cfg = policy.cfg
    split = (degree, unit.step, cfg.train.optimizer_steps, cfg.algorithm.group_size)
    shares = [samples.train_idx[share_rows(samples, r, *split)] for r in range(degree)]
    steps = lockstep_steps(shares, cfg.train.micro_batch, unit.tsp_rank, unit.tsp_degree)
    own = share_rows(samples, rank, *split)
    padding = len(own) == 0  # fewer samples than ranks: this rank only keeps the group's passes in step
    mine = select_rows(samples, own if not padding else torch.zeros(1, dtype=torch.long))
    reference = cfg.algorithm.kl_beta > 0 and samples.ref_means is None  # a KL forward per step
    if cfg.train.pair_batch and not reference:
        # pair batches: every rank runs its busiest rank's number of forwards, each forward both of two
        # experts, high-noise first, on its rows (a dummy row where it has none: the adapter's lockstep);
        # a KL reference forward per step keeps the per-step passes (ranks would run different ones)
        positions = len(range(unit.tsp_rank, samples.train_idx.shape[1], unit.tsp_degree))
        passes = max(-(-len(s) * positions // cfg.train.pair_batch) for s in shares)
        share = (unit.tsp_rank, unit.tsp_degree)
        with policy.adapter.lockstep(True):
            return train_unit(policy, mine, total_terms, *share, padding=padding, pair_passes=passes)
    return train_unit(
        policy, mine, total_terms, unit.tsp_rank, unit.tsp_degree, lockstep=steps, padding=padding
    )


def lockstep_steps(shares: list[torch.Tensor], micro_batch: int, tsp_rank: int, tsp_degree: int):
    """Per micro-batch, the steps every rank of a sharded group runs a train forward / backward at:
    the union of the steps its ranks' samples train (``shares``: each rank's ``train_idx`` rows; as
    many micro-batches as the largest share has).
    FSDP2 gathers the parameters per forward and reduce-scatters per backward, so the ranks must run
    the same passes; with random trained timesteps (DanceGRPO) their samples train different steps,
    and a rank runs a zero-weighted pass where it has none (:func:`~digenrl.units.train.train_unit`)."""
    per_rank = []
    for idx in shares:
        positions = [j for j in range(idx.shape[1]) if j % tsp_degree == tsp_rank]
        per_rank.append([set(mb[:, positions].unique().tolist()) for mb in idx.split(micro_batch)])
    # a rank with fewer micro-batches (an uneven split) runs the others' as zero-weighted passes
    return [sorted(set().union(*batch)) for batch in itertools.zip_longest(*per_rank, fillvalue=set())]


# -- generation (TAG, colocated): the group rolls out each unit together -------------------------


def unit_share(groups: tuple, span: tuple[int, int], share: int, shares: int):
    """The (groups, sample range) share ``share`` of ``shares`` of a rollout unit generates: whole
    groups when they split evenly, else an equal slice of every group's samples, else the whole unit
    (every share generates all of it; the lead keeps one)."""
    lo, hi = span
    if len(groups) % shares == 0:
        k = len(groups) // shares
        return tuple(groups[share * k : (share + 1) * k]), span
    if (hi - lo) % shares == 0:
        w = (hi - lo) // shares
        return tuple(groups), (lo + share * w, lo + (share + 1) * w)
    return tuple(groups), span


def _timesteps_forwards(cfg, iteration: int, groups, span) -> list[int]:
    """The model forwards a share's rollout runs at each step (`units.rollout.forward_batches`)."""

    _, train_idx = _timestep_selection(cfg, iteration, cfg.train.seed, list(groups), span)
    batches = forward_batches(train_idx, cfg, span[1] - span[0], span[0])
    return [1] * cfg.sampling.steps if batches is None else [len(b) for b in batches]


def _reference_steps(cfg, iteration: int, parts) -> list[int]:
    """The steps any share of a unit trains: where every rank of a sharded group runs a KL reference
    forward at rollout (``algorithm.kl_reference: rollout``), whatever its own samples train."""
    steps = set()
    for groups, span in parts:
        steps |= set(
            _timestep_selection(cfg, iteration, cfg.train.seed, list(groups), span)[1].unique().tolist()
        )
    return sorted(steps)


def rollout_share(worker, unit, share: int, shares: int) -> tuple[Samples, Decoded]:
    """Generate and decode share ``share`` of ``shares`` of ``unit`` (:func:`unit_share`) with the
    worker's weights (the lead scores the merged unit). Every rank of the group calls it:
    sharded ranks gather the parameters per forward together, so every share runs the same forwards
    (``engine.colocated_batch``'s; the trainer's batches when the shares' agree, else one per step)."""

    cfg, G = worker.cfg, worker.cfg.algorithm.group_size
    span = unit.sample_range(G)
    parts = [unit_share(unit.groups, span, s, shares) for s in range(shares)]
    plans = {tuple(_timesteps_forwards(cfg, unit.iteration, g, r)) for g, r in parts}
    groups, mine = parts[share]
    everything = worker.prompts.for_iteration(unit.iteration, cfg.train.prompts_per_iteration)
    rollout = rollout_unit(
        worker.policy,
        [everything[g] for g in groups],
        list(groups),
        unit.iteration,
        cfg.train.seed,
        mine,
        worker.policy.settings.sampling_batch(worker.role),  # engine.colocated_batch (equal on every share)
        whole_forwards=len(plans) > 1,
        reference_steps=_reference_steps(cfg, unit.iteration, parts) if worker.sharded else None,
    )
    if worker.sharded:  # sampling leaves the root's parameters gathered (no backward frees them)
        reshard(worker.policy.adapter.transformer)
    return rollout


def merge_shares(parts: list[tuple[Samples, Decoded]], unit, group_size: int) -> tuple[Samples, Decoded]:
    """One unit's samples and decoded samples, in its order (group by group), from its shares' (in share
    order)."""

    span = unit.sample_range(group_size)
    split = unit_share(unit.groups, span, 0, len(parts))
    if len(parts) == 1 or (split == (tuple(unit.groups), span)):  # one share, or each held all of it
        return parts[0]
    rows = torch.arange(sum(len(p) for p, _ in parts))
    if split[1] != span:  # each share a slice of every group: interleave back into group order
        w = split[1][1] - split[1][0]
        rows = rows.view(len(parts), len(unit.groups), w).transpose(0, 1).reshape(-1)
    shares = [p for p, _ in parts]

    def cat(tensors):
        return None if tensors[0] is None else torch.cat(tensors)[rows]

    prompts = [t for p in shares for t in p.prompts]
    samples = dataclasses.replace(
        shares[0],
        group_ids=list(unit.groups),
        prompts=[prompts[i] for i in rows.tolist()],
        cond=Cond.cat([p.cond for p in shares]).select(rows),
        reward_parts={k: cat([p.reward_parts[k] for p in shares]) for k in shares[0].reward_parts},
        first_sample=span[0],
        timings={"ref_forwards": sum(p.timings.get("ref_forwards", 0) for p in shares)},
        **{f: cat([getattr(p, f) for p in shares]) for f in ROW_FIELDS},
    )
    decoded = Decoded.cat([d for _, d in parts], rows)
    n = len(samples) // len(samples.group_ids)
    samples.preview = (decoded.pixels[::n].clamp(0, 1) * 255).round().to(torch.uint8)
    return samples, decoded


def select_rows(samples: Samples, rows: torch.Tensor) -> Samples:
    """The unit's samples ``rows`` (same iteration, version and groups; per-sample fields cut)."""

    def cut(t):
        return None if t is None else t[rows]

    return dataclasses.replace(
        samples,
        prompts=[samples.prompts[i] for i in rows.tolist()],
        cond=samples.cond.select(rows),
        reward_parts={k: v[rows] for k, v in samples.reward_parts.items()},
        **{f: cut(getattr(samples, f)) for f in ROW_FIELDS},
    )


def reshard(model) -> None:
    """Free every gathered (unsharded) parameter copy of an FSDP2 model. A forward without a backward
    (sampling) leaves the root's gathered (``reshard_after_forward=False``), and the next forward would
    reuse that copy even after the shards changed (an EMA swapped out, say)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def combine_rank_stats(parts: list[dict]) -> dict:
    """One unit's stats from its ranks' shares (sums add; extremes combine)."""
    if len(parts) == 1:
        return parts[0]
    pick = {"ratio_max": max, "is_max": max, "ratio_min": min}
    return {k: pick.get(k, sum)(p[k] for p in parts) for k in parts[0]}
