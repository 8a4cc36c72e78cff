"""Elastic TAG (``engine.tag: auto``, BTS of the authors' RFC, verl-omni#321): InsertTAG only where
the forward search predicts a shorter makespan -- worked examples by hand, the planner's simulator
on a cluster where greedy TAG hurts and one where it helps, the predictions checked against what
happened, and the knob's values."""

from __future__ import annotations

import pytest

from digenrl.config.engine import PoolConfig
from digenrl.config.run import load_config
from digenrl.errors import UserError
from digenrl.placement.plan import Plan
from digenrl.planner.search import search
from digenrl.planner.simulator import Simulator, simulate
from digenrl.schedule.bts import Elastic, UnitTimes
from digenrl.schedule.driver import drive
from digenrl.schedule.scheduler import Scheduler, SchedulerConfig
from digenrl.units.types import RolloutUnit, StepUnit, TrainUnit
from tests.helpers import run_benchmark_here
from tests.test_planner import ConstantCost
from tests.test_scheduler import VirtualTime, check_invariants, pools

# -- the policy alone, by hand -----------------------------------------------------------------


def durations(tag_rollout: float, train: float):
    """1 rollout worker (units of 1 s), 1 trainer rank whose own rollout unit takes ``tag_rollout``."""

    def d(worker, unit):
        if isinstance(unit, RolloutUnit):
            return tag_rollout if worker.startswith("t") else 1.0
        return train if isinstance(unit, TrainUnit) else 0.1

    return d


def run(tag, d, priors: bool = True, depth: int = 1, rollout: int = 1):
    """3 iterations of 4 units (GAP, on-policy) on r0 + t0; (time of the last publish, advisor)."""
    cfg = SchedulerConfig(placement="disaggregated", groups_per_iteration=4, iterations=3, tag=tag)
    workers, clock = pools(rollout, 1), []
    names = [w.name for w in workers]
    known = {(k, w): d(w, u) for w in names for k, u in UNITS.items()} if priors else None
    el = Elastic(UnitTimes(known, {w.name: w.role for w in workers}), lambda: clock[0].now, depth=depth)
    sched = Scheduler(cfg, workers, el if tag == "auto" else None)
    clock.append(VirtualTime(sched, workers, d))
    drive(sched, names, clock[0])
    check_invariants(cfg, workers, sched, clock[0].events)
    return clock[0].now, el


UNITS = {
    "rollout": RolloutUnit("r", 0, 0, (0,), 0),
    "train": TrainUnit("t", 0, "r", (0,), 0, 0, 1, 0),
    "step": StepUnit("s", 0, 1),
}


def test_auto_skips_where_greedy_tag_makes_the_trainer_the_bottleneck():
    # The trainer's own rollout unit takes 5 s. Without TAG an iteration is 4 units of 1 s, the last
    # unit's training (1 s) and the step: 5.1 s. Greedy TAG takes a unit at once, so the trainer trains
    # nothing until 5 s and then all 4 units: 9.1 s. BTS predicts exactly those two and skips.
    d = durations(5.0, 1.0)
    assert run(False, d)[0] == pytest.approx(3 * 5.1)
    assert run(True, d)[0] == pytest.approx(3 * 9.1)
    end, el = run("auto", d)
    assert end == pytest.approx(3 * 5.1)
    first = el.decisions[0]
    assert (first.insert_at, first.skip_at, first.insert) == (pytest.approx(9.1), pytest.approx(5.1), False)
    assert not any(x.insert for x in el.decisions)


def test_auto_inserts_where_tag_shortens_the_iteration():
    # The trainer rolls out as fast as the rollout worker and trains in 0.2 s: TAG halves the
    # rollout, and BTS takes every unit greedy TAG takes (the same run, the same decisions).
    d = durations(1.0, 0.2)
    off, on = run(False, d)[0], run(True, d)[0]
    end, el = run("auto", d)
    assert on < off and end == pytest.approx(on)
    assert el.decisions and all(x.insert and x.insert_at < x.skip_at for x in el.decisions)


@pytest.mark.parametrize(("tag_rollout", "train"), [(5.0, 1.0), (1.0, 0.2)])
def test_a_deeper_search_decides_the_same_here(tag_rollout, train):
    # depth 2: every later TAG point inside a branch is itself searched (recursively, bounded)
    d = durations(tag_rollout, train)
    one, two = run("auto", d), run("auto", d, depth=2)
    assert two[0] == pytest.approx(one[0])
    assert [x.insert for x in two[1].decisions] == [x.insert for x in one[1].decisions]


def test_without_rollout_workers_skipping_stalls_so_auto_inserts():
    end, el = run("auto", durations(1.0, 0.2), rollout=0)
    assert end == pytest.approx(run(True, durations(1.0, 0.2), rollout=0)[0])
    assert el.decisions and all(x.insert and x.skip_at == float("inf") for x in el.decisions)
    assert el.event_args("rollout", el.decisions[-1].uid, 2, 0.0, {})["bts"]["skip_s"] is None  # JSON null


def test_without_a_profile_auto_takes_tag_until_the_times_are_measured():
    # No priors: the first TAG point cannot be predicted, so it inserts (as tag: on) and measures the
    # trainer's 5 s rollout; from then on it skips. One slow unit, not one per iteration.
    d = durations(5.0, 1.0)
    end, el = run("auto", d, priors=False)
    reasons = [(x.reason, x.insert) for x in el.decisions]
    assert reasons[0] == ("unmeasured", True) and set(reasons[1:]) == {("predicted", False)}
    assert end < run(True, d)[0]


# -- the planner's simulator: the same decision code on the cost model's times -----------------


class SlowTagCost(ConstantCost):
    """Rollout units take ``tag_rollout`` on the trainer's device type (L40S), 1 s elsewhere."""

    def __init__(self, cfg, tag_rollout: float, train: float):
        super().__init__(cfg, 1.0, train, 0.1)
        self.tag_r = tag_rollout

    def rollout_unit(self, device, groups, setup=None):
        return (self.tag_r if device == "L40S" else self.r), 0.0


def plan(tag, rollout: int = 2, trainers: int = 2) -> Plan:
    pools_ = (
        PoolConfig(name="rollout", device="H100", count=rollout),
        PoolConfig(name="trainer", device="L40S", count=trainers),
    )
    return Plan(placement="disaggregated", pools=pools_, unit_groups=1, tag=tag)


@pytest.mark.parametrize(("tag_rollout", "train", "helps"), [(6.0, 1.0, False), (1.0, 0.2, True)])
def test_the_simulator_runs_bts_on_the_cost_models_times(tiny_cfg, tag_rollout, train, helps):
    cost = SlowTagCost(tiny_cfg("train.prompts_per_iteration=8"), tag_rollout, train)
    it = {tag: simulate(plan(tag), cost, iterations=4).iteration_s for tag in (False, True, "auto")}
    if helps:  # TAG shortens the iteration and BTS takes it
        assert it[True] < it[False] and it["auto"] == pytest.approx(it[True], rel=1e-6)
    else:  # greedy TAG lengthens it (the trainers become the bottleneck); BTS does not
        assert it[True] > it[False] and it["auto"] == pytest.approx(it[False], rel=1e-6)
    sim = Simulator(plan("auto"), cost, iterations=4)
    sim.run()
    tagged = [e for e in sim.timeline.of("rollout") if sim.role[e.worker] == "trainer"]
    assert bool(tagged) == helps
    assert all(e.args["bts"]["insert_s"] < e.args["bts"]["skip_s"] for e in tagged)
    published = [e for e in sim.timeline.of("step") if "publishes" in e.args and "bts" in e.args]
    assert published and {e.args["bts"]["decisions"] > 0 for e in published} == {True}
    # no spread, the priors exact: each predicted publish time is what the simulator then ran
    assert max(e.args["bts"]["mean_abs_error"] for e in published) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(("tag_rollout", "train", "helps"), [(6.0, 1.0, False), (1.0, 0.2, True)])
def test_the_search_ranks_the_auto_twin_of_its_best_plans(tiny_cfg, tag_rollout, train, helps):
    """The planner's search simulates ``tag: auto`` for its best disaggregated plans: auto matches
    TAG where it helps and no TAG where greedy TAG hurts, so it ranks with the better of the two."""
    cost = SlowTagCost(tiny_cfg("train.prompts_per_iteration=8"), tag_rollout, train)
    res = search(cost, cost.cluster, top=2, iterations=4, plans=[plan(False), plan(True)], elastic=True)
    sps = {r.plan.tag: r.samples_per_s for r in res.ranked}
    assert set(sps) == {False, True, "auto"} and res.simulated == 3
    assert sps["auto"] == pytest.approx(max(sps[False], sps[True]), rel=1e-6)
    assert (sps[True] > sps[False]) == helps
    assert search(cost, cost.cluster, top=2, iterations=4, plans=[plan(True)]).simulated == 1  # given plans


def test_measured_times_replace_the_priors():
    times = UnitTimes({("rollout", "t0"): 5.0}, {"t0": "trainer", "t1": "trainer"})
    assert times.get("rollout", "t0") == 5.0 and times.get("rollout", "t1") is None
    times.measure("rollout", "t0", 2.0)
    times.measure("rollout", "t0", 4.0)
    assert times.get("rollout", "t0") == 3.0 and times.get("rollout", "t1") == 3.0  # its pool's mean
    assert times.get("score", "t1") == 0.0  # nothing released yet: scored inside the unit


@pytest.mark.parametrize(("value", "want"), [("auto", "auto"), ("on", True), ("off", False), ("true", True)])
def test_engine_tag_takes_auto_on_off_and_the_old_booleans(value, want):
    cfg = load_config(None, [f"engine.tag={value}"])
    assert cfg.engine.tag == want
    assert (
        Plan.from_run_config(load_config(None, ["placement.mode=disaggregated", f"engine.tag={value}"])).tag
        == want
    )


def test_a_bad_engine_tag_names_the_field():
    with pytest.raises(UserError, match="engine.tag: must be auto, on or off"):
        load_config(None, ["engine.tag=sometimes"])


def test_the_decision_cost_benchmark_runs(tmp_path):
    """benchmarks/bts_cost.py on 2 + 2 GPUs for 2 iterations: a row per placement and tag, and for
    auto its decisions (their cost is the benchmark's to report, never judged here)."""
    cluster = tmp_path / "small.yaml"
    cluster.write_text(
        "name: small\ninterconnect: {bandwidth_gb_s: 50, latency_us: 10}\npools:\n"
        "  - {name: h100, device: H100, count: 2}\n  - {name: l40s, device: L40S, count: 2}\n"
    )
    rows = run_benchmark_here("bts_cost.py", tmp_path, "--cluster", str(cluster), "--iterations", "2")
    assert [(r["rollout"], r["tag"]) for r in rows] == [
        (r, tag) for r in ("l40s", "h100") for tag in (False, True, "auto")
    ]
    auto = [r for r in rows if r["tag"] == "auto"]
    assert all(r["decisions"] > 0 and r["ms_per_decision"] > 0 for r in auto)
