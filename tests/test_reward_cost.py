"""What the planner charges for rewards (digenrl/planner/call_times.py ``reward_per_image``,
``CostModel.reward_hidden``): a model reward's seconds per image on the rollout device and its weights
in the rollout worker's memory, a remote judge's configured latency (no weights), and the overlap the
engine really has -- a rollout-only worker scores a unit beside its next one (``EngineWorker.score``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from digenrl.config.run import load_config
from digenrl.placement.plan import Plan
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import cluster_from_dict
from digenrl.planner.params import CostParams
from digenrl.planner.simulator import simulate
from digenrl.planner.workload import Workload
from tests.helpers import FULL_MODE

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.prompts_per_iteration=4", "algorithm.group_size=8", "sampling.steps=8"]
PICK = "reward.components=[{name: pickscore, args: {path: /models/pickscore}}]"
JUDGE = "reward.components=[{name: remote, args: {url: 'http://judge:8000/score'}, seconds_per_image: 0.05}]"
POOLS = [{"name": "rollout", "device": "H100", "count": 1}, {"name": "trainer", "device": "H100", "count": 1}]
CLUSTER = cluster_from_dict({"name": "1+1xH100", "pools": POOLS})
PLAN = Plan.from_run_config(
    load_config(
        None,
        [
            *FULL_MODE,
            "engine.unit_groups=1",
            "engine.tag=false",
            "cluster.pools=[{name: rollout, device: H100, count: 1}, {name: trainer, device: H100, count: 1}]",  # noqa: E501
        ],
    )
)


def workload(*sets: str) -> Workload:
    return Workload.from_config(load_config(ROOT / "configs" / "flux1_dev.yaml", SMALL + list(sets)))


def test_a_model_reward_costs_rollout_device_time_and_memory():
    fn, pick, judge = (CostModel(workload(*s), CLUSTER) for s in ((), (PICK,), (JUDGE,)))
    b, p = 8, CostParams()  # a unit of 1 group of 8
    (t_fn, r_fn), (t_pick, r_pick) = fn.rollout_unit("H100", 1), pick.rollout_unit("H100", 1)
    assert r_fn == pytest.approx(b * p.weight_free_reward_s) and r_pick == pytest.approx(b * p.model_reward_s)
    assert t_pick - t_fn == pytest.approx(b * (p.model_reward_s - p.weight_free_reward_s))
    assert pick.times("H100").reward_wait(b) == 0.0  # all of it on the device
    # its weights sit on the rollout device; a remote judge's do not, and it costs its configured latency
    held = fn.memory.rollout_models()
    assert pick.memory.rollout_models() - held == pytest.approx(2 * p.model_reward_params)
    assert judge.memory.rollout_models() == held
    assert judge.rollout_unit("H100", 1)[1] == pytest.approx(b * 0.05)
    assert judge.times("H100").reward_wait(b) == pytest.approx(b * 0.05)
    measured = workload(PICK.replace("}}]", "}, seconds_per_image: 0.03}]"))
    assert CostModel(measured, CLUSTER).rollout_unit("H100", 1)[1] == pytest.approx(b * 0.03)


def _rollout_row(res) -> tuple[float, list, list]:
    """Busy seconds of the rollout worker's rollout units, its rollout and its reward events."""
    rows = [e for e in res.timeline.events if e.worker == "rollout0"]
    units = [e for e in rows if e.kind == "rollout"]
    return sum(e.end - e.start for e in units), units, [e for e in rows if e.kind == "reward"]


def test_a_rollout_worker_scores_beside_its_next_unit_for_less_than_the_serial_sum():
    judge = workload(JUDGE)
    assert judge.reward_after_unit and not workload(PICK, "reward.service={}").reward_after_unit
    overlapped = simulate(PLAN, CostModel(judge, CLUSTER), iterations=3)
    serial = simulate(PLAN, CostModel(replace(judge, reward_after_unit=False), CLUSTER), iterations=3)
    busy, units, rewards = _rollout_row(overlapped)
    busy_serial, _, _ = _rollout_row(serial)
    hidden = 8 * 0.05  # the judge's whole wait, per unit of 8 samples
    assert busy < busy_serial and busy == pytest.approx(busy_serial - len(units) * hidden, rel=1e-6)
    # the reward spans run past their unit, beside the worker's next rollout unit
    nxt = {a.uid: b for a, b in zip(units, units[1:])}
    assert any(r.end > nxt[r.uid].start + 1e-9 for r in rewards if r.uid in nxt)
    assert all(r.end - r.start == pytest.approx(hidden) for r in rewards)
    assert overlapped.samples_per_s >= serial.samples_per_s * (1 - 1e-9)
    # a model on the device hides only the share model_reward_overlap (the GPU check's, by default)
    pick = workload(PICK)
    none = CostModel(pick, CLUSTER, params=CostParams(model_reward_overlap=0.0))
    half = CostModel(pick, CLUSTER, params=CostParams(model_reward_overlap=0.5))
    default = CostModel(pick, CLUSTER).reward_hidden("H100", 1)
    assert none.reward_hidden("H100", 1) == 0.0
    assert default == pytest.approx(0.365 * 8 * CostParams().model_reward_s)
    assert half.reward_hidden("H100", 1) == pytest.approx(0.5 * 8 * CostParams().model_reward_s)
    assert (
        _rollout_row(simulate(PLAN, half, iterations=3))[0]
        < _rollout_row(simulate(PLAN, none, iterations=3))[0]
    )


def test_ocr_costs_its_measured_seconds_per_image_at_the_run_size():
    """``ocr`` unconfigured costs what benchmarks/ocr_reward.py measured (planner MEASURED_REWARD_S):
    the 512-px figure at 512 px, the 256-px one at 256, interpolated in pixels between them."""
    from digenrl.planner.constants import MEASURED_REWARD_S

    table = dict(MEASURED_REWARD_S["ocr"])
    ocr = "reward.components=[{name: ocr}]"
    for side, expect in ((512, table[512]), (256, table[256])):
        w = workload(ocr, f"model.height={side}", f"model.width={side}")
        assert CostModel(w, CLUSTER).rollout_unit("H100", 1)[1] == pytest.approx(8 * expect)
    mid = workload(ocr, "model.height=256", "model.width=512")  # half-way in pixels from 256² to 512²
    half = table[256] + (table[512] - table[256]) * (256 * 512 - 256**2) / (512**2 - 256**2)
    assert CostModel(mid, CLUSTER).rollout_unit("H100", 1)[1] == pytest.approx(8 * half)
    # on the CPU: no weights on the rollout device (a device model reward's would be there)
    plain = workload("model.height=512", "model.width=512")
    w512 = workload(ocr, "model.height=512", "model.width=512")
    assert (
        CostModel(w512, CLUSTER).memory.rollout_models() == CostModel(plain, CLUSTER).memory.rollout_models()
    )
    assert w512.reward_after_unit  # scored after the unit on a rollout worker, as the engine does
    given = workload(
        ocr.replace("ocr}", "ocr, seconds_per_image: 0.2}"), "model.height=512", "model.width=512"
    )
    assert CostModel(given, CLUSTER).rollout_unit("H100", 1)[1] == pytest.approx(8 * 0.2)


def test_a_judge_served_on_the_cluster_costs_what_a_model_reward_costs():
    """``server: cluster`` (a vLLM judge sharing the run's GPUs, veRL-Omni's REWARD_TP=4 layout): its
    seconds take the scoring device's time, none of it hidden, and its weights sit on the device --
    exactly what a model reward at the same seconds per image costs."""
    on = workload(JUDGE.replace("seconds_per_image", "server: cluster, seconds_per_image"))
    pick = workload(PICK.replace("}}]", "}, seconds_per_image: 0.05}]"))
    remote = CostModel(workload(JUDGE), CLUSTER)
    on_cost, pick_cost = CostModel(on, CLUSTER), CostModel(pick, CLUSTER)
    assert on_cost.rollout_unit("H100", 1) == pytest.approx(pick_cost.rollout_unit("H100", 1))
    assert on_cost.times("H100").reward_wait(8) == 0.0 < remote.times("H100").reward_wait(8)
    assert on_cost.memory.rollout_models() == pytest.approx(pick_cost.memory.rollout_models())
    assert on_cost.memory.rollout_models() > remote.memory.rollout_models()
    served = _rollout_row(simulate(PLAN, on_cost, iterations=3))[0]
    assert served > _rollout_row(simulate(PLAN, remote, iterations=3))[0]  # nothing hides behind the unit
