"""A train unit's seconds with timestep-pair batches (``train.pair_batch``; "TSP as (sample, timestep)
pairs" in the authors' RFC, verl-project/verl-omni#321): the unit's (sample, trained step) pairs in
forwards of ``pair_batch`` rows, so each forward's fixed costs (its kernels' launches, FSDP's
all-gathers: ``AnalyticTimes._pass`` / ``fsdp_s``) are paid once per chunk, not once per distinct
step and micro-batch (``call_times.train_unit_time``). docs/algorithms.md, "Timestep-pair batches"."""

from __future__ import annotations

from collections import Counter

from digenrl.planner.call_times import CallTimes, micro_batches, train_unit_time
from digenrl.planner.constants import MIN_UNIT_FRACTION
from digenrl.planner.workload import Workload

#: chunk sizes the planner tries, in multiples of the run's micro-batch (beside per-step forwards)
PAIR_MULTIPLES = (1, 2, 4)


def pair_sizes(w: Workload) -> tuple[int | None, ...]:
    """``train.pair_batch`` values the search tries: off, and :data:`PAIR_MULTIPLES` x the micro-batch
    (a chunk of N rows holds N samples' activations: the memory model checks it, ``bound.setups``);
    off only where the engine has no pairs (diffusion_nft-style losses)."""
    if w.forward_process:
        return (None,)
    return (None, *(k * w.micro_batch for k in PAIR_MULTIPLES))


def uses_pairs(w: Workload, pair_batch: int | None, shard: int) -> bool:
    """Does the engine run pair batches here? Not for the forward-process losses; not in a sharded
    group with a KL reference forward per step (``engine/fsdp_group.py``: ranks would run different
    collectives, so the group keeps its per-step passes)."""
    if not pair_batch or w.forward_process:
        return False
    return shard <= 1 or not w.kl_on_trainer


def pieces(steps: float, rows: float, size: int) -> list[float]:
    """Rows of each (chunk, step) piece: ``steps`` steps of ``rows`` rows each, in step order, cut into
    chunks of ``size`` rows (a step's rows may span two chunks): the KL reference's forwards, which
    stay per step inside a chunk (``units/train.py: _term``)."""
    out, room = [], float(size)
    whole, frac = int(steps), steps - int(steps)
    for r in [rows] * whole + ([rows * frac] if frac > 1e-9 else []):
        while r > 1e-9:
            take = min(r, room)
            out.append(take)
            r, room = r - take, room - take
            if room <= 1e-9:
                room = float(size)
    return out


def pair_unit_time(
    t: CallTimes,
    w: Workload,
    groups: int,
    tsp_rank: int,
    tsp_degree: int,
    micro_batch: int,
    pair_batch: int | None,
    shard: int = 1,
    old_logprob: bool | None = None,
) -> float:
    """A train unit: its b x positions pairs (b = the mini-batch's samples) as ceil(pairs / pair_batch)
    forward + backward calls of up to ``pair_batch`` rows; a KL reference on the trainer per (chunk,
    step) piece. ``old_logprob`` (default: the workload's ``train.old_logprob: recompute``): also a
    no-grad forward per chunk before them (veRL-Omni's old_log_prob pass: the ratio's reference from
    the trainer's own kernels; ``units/train.py: old_logprobs``). Where the engine keeps per-step
    forwards (:func:`uses_pairs`), ``call_times.train_unit_time``."""
    old_logprob = w.old_logprob if old_logprob is None else old_logprob
    if not uses_pairs(w, pair_batch, shard):
        return train_unit_time(t, w, groups, tsp_rank, tsp_degree, micro_batch)
    b = groups * w.group_size // w.optimizer_steps
    positions = w.positions(tsp_rank, tsp_degree)
    chunks = micro_batches(b * positions, pair_batch)
    sizes = Counter(chunks)  # most chunks are whole: one call's time per distinct size
    calls = sum(n * t.train_step(c) for c, n in sizes.items())
    if w.shape.experts > 1 and shard > 1:  # a sharded rank runs both experts per chunk (lockstep)
        calls = sum(2 * n * t.train_step(c / 2) for c, n in sizes.items())
    if old_logprob:
        calls += sum(n * t.ref_forward(c) for c, n in sizes.items())
    if w.kl_on_trainer:
        if w.timestep_mode == "random":  # the mini-batch's distinct steps (expected), pairs spread over them
            choices = max(1, w.steps - 1)
            k = choices * (1 - (1 - min(1.0, positions / choices)) ** b)
            per = b * positions / k if k else 0.0
        else:
            k, per = positions, b
        calls += sum(t.ref_forward(p) for p in pieces(k, per, pair_batch))
    return max(MIN_UNIT_FRACTION * calls, calls * t.train_unit_factor + t.train_overhead_s)
