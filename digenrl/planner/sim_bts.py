"""The simulator's elastic TAG (``tag: auto``): the engine's own BTS advisor
(:class:`~digenrl.schedule.bts.Elastic`) on the simulator's clock, its priors the cost model's unit
times as the simulator pays them (the run then measures its own, as a real run does)."""

from __future__ import annotations

from digenrl.planner.bound import unit_train_time
from digenrl.schedule.bts import Elastic, UnitTimes
from digenrl.schedule.scheduler import SchedulerConfig


def priors(sim, cfg: SchedulerConfig) -> dict[tuple[str, str], float]:
    """(kind, worker) -> predicted seconds, from the cost model (``sim``: a planner Simulator):
    a rollout unit (the worker busy: a rollout-only worker scores a model reward after it, the
    ``score`` wait; a TAG rank switches to sampling first), a train unit (TSP rank 0's share), a
    rank's optimizer step."""
    cost, call = sim.cost, sim.cost.overheads.call_s
    size = cfg.unit_groups / cfg.group_parts
    out = {}
    for w in sim.order:
        pool = sim.pool[w]
        dev, setup = pool.device, sim.setups[pool.name]
        total, _ = cost.rollout_unit(dev, size, setup)
        hidden = cost.reward_hidden(dev, size, setup) if sim.role[w] == "rollout" else 0.0
        out[("rollout", w)], out[("score", w)] = call + total - hidden, hidden
        if sim.role[w] == "trainer":  # a TAG unit: the switch to sampling (the one back: the next unit's)
            out[("rollout", w)] += cost.switch(dev, setup)
        if sim.role[w] != "rollout":
            train = unit_train_time(cost, dev, cfg.unit_groups, cfg.group_parts, 0, cfg.tsp_degree, setup)
            out[("train", w)] = call + train
            out[("step", w)] = call + cost.step(dev, len(sim.ranks), False, setup)[0]
    return out


def elastic(sim, cfg: SchedulerConfig) -> Elastic | None:
    """The advisor of a disaggregated ``tag: auto`` plan (else None: the scheduler's fixed rules)."""
    if cfg.tag != "auto" or cfg.placement != "disaggregated":
        return None
    peers = {w: sim.pool[w].name for w in sim.order}
    return Elastic(UnitTimes(priors(sim, cfg), peers), clock=lambda: sim.now)


def bts_event(ev: dict, now: float) -> dict:
    """:meth:`Elastic.event_args`' arguments for a simulator event dict ending ``now``."""
    return dict(kind=ev["kind"], uid=ev["uid"], iteration=ev["iteration"], end=now, args=ev.get("args", {}))
