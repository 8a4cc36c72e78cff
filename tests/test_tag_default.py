"""``engine.tag`` unset (the default): elastic TAG where a trainer rank's memory is known to hold a
rollout unit beside its training state at its own setup, off elsewhere; BTS then starts from the
cost model's unit times, so its first decision is predicted (placement/tag_choice.py)."""

from __future__ import annotations

import pytest

from digenrl.placement.layout import RunLayout
from digenrl.placement.resolve import resolve
from digenrl.schedule.bts import UnitTimes, elastic_for
from digenrl.schedule.driver import drive
from digenrl.schedule.scheduler import Scheduler
from digenrl.units.types import RolloutUnit, StepUnit, TrainUnit
from tests.test_scheduler import VirtualTime, check_invariants

H100 = "cluster.pools=[{name: rollout, device: H100, count: 2}, {name: trainer, device: H100, count: 2}]"
CPU = "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 1}]"
KIND = {RolloutUnit: "rollout", TrainUnit: "train", StepUnit: "step"}


@pytest.fixture(scope="module")
def gpu_layout():
    from digenrl.config.run import load_config
    from tests.helpers import TINY

    sets = [*TINY, "train.prompts_per_iteration=8", "engine.gap=true", "placement.mode=disaggregated", H100]
    return resolve(load_config(None, sets))


def test_unset_tag_is_auto_where_a_trainer_rank_holds_a_rollout_unit(gpu_layout):
    assert gpu_layout.plan.tag == "auto" and "TAG auto" in gpu_layout.tag_note
    assert gpu_layout.tag_note in gpu_layout.describe() and "TAG auto" in gpu_layout.plan.label()
    priors = {(k, w): s for k, w, s in gpu_layout.bts_priors}
    for w in gpu_layout.scheduled:  # every time BTS asks for at its first decision
        kinds = ("rollout", "score") + (("train", "step") if w.role == "trainer" else ())
        assert all(priors[(k, w.name)] >= 0 for k in kinds)
    # a TAG unit pays the trainer's switch to sampling: dearer than the same unit on a rollout worker
    assert priors[("rollout", "trainer0")] > priors[("rollout", "rollout0")]
    again = RunLayout.from_dict(gpu_layout.to_dict())  # layout.json keeps them
    assert again.bts_priors == gpu_layout.bts_priors and again.tag_note == gpu_layout.tag_note


def test_from_the_priors_no_decision_is_a_guess(gpu_layout):
    """A run whose unit times are the priors: every BTS decision predicted (without priors the first
    is taken unmeasured, as tag: on), and the iteration no longer than with TAG on or off."""
    priors = {(k, w): s for k, w, s in gpu_layout.bts_priors}

    def d(worker, unit):
        return priors[(KIND[type(unit)], worker)]

    def run(tag, known):
        cfg = gpu_layout.scheduler_config()
        cfg = type(cfg)(**{**vars(cfg), "tag": tag, "iterations": 2})
        clock = []
        el = elastic_for(cfg, gpu_layout.scheduled, lambda: clock[0].now, known)
        sched = Scheduler(cfg, gpu_layout.scheduled, el)
        clock.append(VirtualTime(sched, gpu_layout.scheduled, d))
        drive(sched, [w.name for w in gpu_layout.scheduled], clock[0])
        check_invariants(cfg, gpu_layout.scheduled, sched, clock[0].events)
        return clock[0].now, el

    end, el = run("auto", priors)
    assert el.decisions and {x.reason for x in el.decisions} == {"predicted"}
    assert run("auto", None)[1].decisions[0].reason == "unmeasured"
    assert end <= min(run(True, None)[0], run(False, None)[0]) * (1 + 1e-9)


@pytest.mark.parametrize(
    ("sets", "tag", "note"),
    [
        ([CPU], False, "trainer memory unknown"),  # logical CPU devices: as before, off
        (["placement.mode=colocated"], False, ""),  # colocated devices roll out anyway
        ([H100, "engine.tag=off"], False, ""),  # an explicit value as written
        ([CPU, "engine.tag=auto"], "auto", ""),
    ],
)
def test_unset_tag_elsewhere_and_explicit_values(tiny_cfg, sets, tag, note):
    layout = resolve(tiny_cfg("placement.mode=disaggregated", *sets))
    assert layout.plan.tag == tag and note in layout.tag_note and (note or not layout.tag_note)
    assert layout.bts_priors == ()  # tag auto on CPU pools: the run measures its own times


def test_unset_tag_is_off_where_tag_would_change_the_trainers_setup():
    """FLUX.1-dev's trainer on 8 x L40S fits replicated, but beside a unit of 4 groups only at FSDP x2:
    the default keeps the trainer's setup and says why (an explicit auto would shard instead)."""
    from pathlib import Path

    from digenrl.config.run import load_config
    from digenrl.placement.preflight import memory_model
    from digenrl.placement.tag_choice import settle_tag

    pools = "cluster.pools=[{name: rollout, device: H100, count: 8}, {name: trainer, device: L40S, count: 8}]"
    cfg = load_config(Path("configs/flux1_dev.yaml"), ["engine.tag=null", pools])
    settled, why = settle_tag(cfg, memory_model(cfg))
    assert settled.engine.tag is False and "FSDP x2 (not FSDP x1)" in why
    small = load_config(Path("configs/flux1_dev.yaml"), ["engine.tag=null", "engine.unit_groups=1", pools])
    assert settle_tag(small, memory_model(small))[0].engine.tag == "auto"


def test_a_pools_measurements_come_before_a_prior():
    times = UnitTimes({("rollout", "t1"): 9.0}, {"t0": "trainer", "t1": "trainer"})
    assert times.get("rollout", "t1") == 9.0
    times.measure("rollout", "t0", 2.0)
    assert times.get("rollout", "t1") == 2.0  # the pool's own speed, not the cost model's guess
