"""Which rows and which random stream a unit's work uses: plain functions that the units of every
algorithm (units.py, units_nft.py) share, so that any split of a unit -- worker, batch, TSP rank --
draws and trains exactly the same samples."""

from __future__ import annotations

import hashlib

import torch


def stream_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def minibatch_rows(
    n: int, group_size: int, minibatch: int, minibatches: int, per_group: int | None = None, first: int = 0
) -> torch.Tensor:
    """Mini-batch PPO: the rows (of ``n`` samples, ``per_group`` of each group in a row: samples
    ``first ..`` of it; default whole groups) of mini-batch ``minibatch``: the in-group samples
    s*G/S .. (s+1)*G/S - 1 of every group (S = ``minibatches`` divides G). Every mini-batch holds a
    slice of every group, as in DanceGRPO (each rank's group in gradient-accumulation chunks) and
    flow_grpo (a random split of all samples)."""
    rows = torch.arange(n)
    if minibatches == 1:
        return rows
    in_group = first + rows % (per_group or group_size)
    return rows[in_group // (group_size // minibatches) == minibatch]


def train_batches(
    n: int, cfg, minibatch: int = 0, minibatches: int = 1, per_group: int | None = None, first: int = 0
) -> list[torch.Tensor]:
    """The rows of each train forward of mini-batch ``minibatch`` (of a unit of ``n`` samples, as in
    :func:`minibatch_rows`): its rows in ``train.micro_batch`` chunks."""
    rows = minibatch_rows(n, cfg.algorithm.group_size, minibatch, minibatches, per_group, first)
    return [mb for mb in rows.split(cfg.train.micro_batch) if len(mb)]


def host_values(stats: dict) -> dict:
    """A unit's stats as numbers: its sums kept on the device (a term's forward or backward never
    waits to report one), read from there at once when the unit ends."""
    keys = [k for k, v in stats.items() if isinstance(v, torch.Tensor)]
    read = torch.stack([stats[k].detach().float().reshape(()).cpu() for k in keys]).tolist() if keys else []
    return {**stats, **dict(zip(keys, read))}
