"""The planner: cluster files, analytic cost model, memory model, the simulator (driving the engine's
own Scheduler in virtual time), the placement search and the `digenrl plan` command."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from digenrl.cli.app import app
from digenrl.config.engine import PoolConfig
from digenrl.config.run import load_config
from digenrl.engine.timeline import Timeline
from digenrl.errors import UserError
from digenrl.placement.devices import DEVICES, match_device_name
from digenrl.placement.plan import Plan
from digenrl.planner.bound import bound
from digenrl.planner.call_times import AnalyticTimes, interpolate
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import cluster_from_dict, load_cluster
from digenrl.planner.params import CostParams, EngineOverheads
from digenrl.planner.search import candidates, search
from digenrl.planner.shapes import attention_fraction, forward_flops, model_shape
from digenrl.planner.simulator import simulate
from digenrl.planner.workload import Workload
from digenrl.schedule.scheduler import Scheduler
from digenrl.units.types import RolloutUnit, StepUnit, TrainUnit
from tests.helpers import FULL_MODE, TINY_IMAGE, as_sets
from tests.helpers import cli as cli_main

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "configs" / "clusters"
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def exit_code(result) -> int:
    """CliRunner surfaces a UserError as the exception; the entry point turns it into exit 2."""
    if isinstance(result.exception, UserError):
        return result.exception.exit_code
    return result.exit_code


# ----------------------------------------------------------------------------- hardware


def test_cluster_files_load():
    for path in sorted(CLUSTERS.glob("*.yaml")):
        cluster = load_cluster(path)
        assert sum(cluster.devices.values()) >= 1, path  # 1x24GB, 1x48GB: docs/fit.md
    assert load_cluster(CLUSTERS / "8xH800_16xH20.yaml").devices == {"H800": 8, "H20": 16}
    assert load_cluster(CLUSTERS / "local_cpu.yaml").is_cpu


def test_unknown_device_type_lists_the_known_ones(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - {name: x, device: B200, count: 8}\n")
    with pytest.raises(UserError, match=r"unknown device type 'B200' \(known: H100, H200, H800, H20"):
        load_cluster(bad)
    result = cli("plan", "--cluster", str(bad))
    assert exit_code(result) == 2


def test_device_names_match_the_table():
    assert match_device_name("NVIDIA H200") == "H200"  # not H20
    assert match_device_name("NVIDIA H20") == "H20"
    assert match_device_name("NVIDIA H100 80GB HBM3") == "H100"
    assert match_device_name("NVIDIA GeForce RTX 4090") == "RTX4090"
    assert match_device_name("Tesla T4") is None
    with pytest.raises(UserError, match="unknown key"):
        cluster_from_dict({"pools": [{"name": "a", "device": "H100", "count": 1}], "nodes": 2})


# ---------------------------------------------------------------------------- cost model


def test_interpolation_is_exact_at_points_linear_between_and_extrapolates():
    table = {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5}
    assert interpolate(table, 4) == 2.5
    assert interpolate(table, 3) == pytest.approx(2.0)
    assert interpolate(table, 16) == pytest.approx(8.5)  # along the last segment (0.5 s per sample)
    assert interpolate(table, 6) == pytest.approx(3.5)
    # below the table: never free, never dearer than the smallest batch measured
    noisy = {8: 0.05, 16: 0.11}  # a first segment steeper than linear: extrapolated, b = 1 would cost < 0
    assert interpolate(noisy, 1) == pytest.approx(0.05 / 8)
    assert 0.05 / 8 * 4 <= interpolate(noisy, 4) <= 0.05


def test_a_run_configs_micro_batch_is_simulated_as_configured(monkeypatch):
    """A plan read from a run config trains at its micro-batch even when a (noisy) profile makes a
    smaller one look cheaper per sample; the search, free to choose, may pick the smaller one."""
    cfg = load_config(
        None,
        [
            "train.micro_batch=16",
            "algorithm.group_size=8",
            "engine.unit_groups=2",
            "train.prompts_per_iteration=4",
        ],
    )
    w = Workload.from_config(cfg)
    cluster = load_cluster(CLUSTERS / "local_cpu.yaml")
    cheap8 = {8: 0.040, 16: 0.100}  # per sample: 5 ms at 8, 6.25 ms at 16 (checkpointing: +1 forward)
    monkeypatch.setattr(
        AnalyticTimes,
        "train_step",
        lambda self, b: interpolate(cheap8, b) * (1.3 if self.checkpointing else 1.0),
    )
    cost = CostModel(w, cluster)
    assert cost.trainer_setup("cpu", 1, False, 2).micro_batch == 8
    assert cost.trainer_setup("cpu", 1, False, 2, micro_batch=16).micro_batch == 16
    assert cost.colocated_setup("cpu", 2, 2, micro_batch=16).micro_batch == 16


@pytest.mark.parametrize(
    "overrides, groups",
    [
        (["train.optimizer_steps=4", "train.micro_batch=16"], 2),
        (["train.optimizer_steps=2", "train.micro_batch=3"], 2),  # micro-batches that straddle groups
        (["train.optimizer_steps=2", "train.micro_batch=16"], 0.5),  # a part: samples 0..3 of one group
        (["train.optimizer_steps=4", "train.micro_batch=1"], 0.25),
        (["train.optimizer_steps=1", "train.micro_batch=16"], 1),  # one forward of the whole unit
    ],
    ids=["S4", "S2-micro3", "S2-part", "S4-micro1", "S1"],
)
def test_the_cost_model_forwards_in_the_runtimes_batches(tiny_cfg, overrides, groups):
    """A rollout unit forwards in the train forwards' batches and a train unit is one mini-batch:
    the cost model composes them from the same batch sizes the runtime runs (digenrl.units)."""
    from digenrl.planner.call_times import micro_batches, minibatch_samples
    from digenrl.units.rows import train_batches

    cfg = tiny_cfg("algorithm.group_size=8", *overrides)
    w, S, G = Workload.from_config(cfg), cfg.train.optimizer_steps, 8
    m, per_group = (groups, G) if groups >= 1 else (1, int(groups * G))
    runtime = [len(b) for s in range(S) for b in train_batches(m * per_group, cfg, s, S, per_group)]
    assert [c for n in minibatch_samples(w, groups) for c in micro_batches(n, w.micro_batch)] == runtime
    if groups >= 1:  # a train unit: one mini-batch of the unit's whole groups, all its trained steps
        from types import SimpleNamespace

        from digenrl.planner.call_times import train_unit_time

        per_sample = SimpleNamespace(
            train_step=lambda b: b, ref_forward=lambda b: b, train_unit_factor=1.0, train_overhead_s=0.0
        )  # one second per sample and forward
        assert train_unit_time(per_sample, w, m, 0, 1, w.micro_batch) == pytest.approx(
            w.trained_steps * m * G / S
        )


@pytest.mark.parametrize("name", ["flux1_dev", "wan2.1_t2v_14b_240p", "hunyuan_video", "qwen_image"])
def test_known_shapes_and_flops(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    w = Workload.from_config(cfg)
    published = {"flux": 11.9e9, "wan": 14.0e9, "hunyuan_video": 12.8e9, "qwen_image": 20.4e9}[
        cfg.model.adapter
    ]
    assert w.params.total == pytest.approx(published, rel=0.03)
    assert 0 < w.params.lora < 0.05 * w.params.total
    # doubling every token doubles the linear FLOPs and quadruples the attention products
    shape = w.shape
    t = shape.tokens
    doubled = type(t)(2 * t.x, 2 * t.text, t.latent_elements, t.pixels)
    ratio = forward_flops(shape, doubled) / forward_flops(shape)
    a = attention_fraction(shape)
    assert ratio == pytest.approx(2 * (1 - a) + 4 * a, rel=0.02)
    assert 2.0 <= ratio <= 3.0
    # and FLOPs per token are ~2 x the parameters a token passes through (a dual-stream block sends a
    # token through one stream; the modulation weights act once per sample)
    per_token = forward_flops(shape) / (t.x + t.text)
    assert 0.5 * w.params.total < per_token < 4 * w.params.total


@pytest.mark.parametrize("name", ["flux_tiny", "wan_tiny", "hunyuan_tiny", "qwen_tiny"])
def test_flop_formula_matches_torch_flop_counter_on_the_tiny_models(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from digenrl.adapters import build_adapter

    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    ad = build_adapter(cfg.model, cfg.sampling)
    shape = model_shape(cfg.model)
    assert shape.tokens.latent_elements == torch.Size(ad.latent_shape()).numel()
    cond = ad.encode_prompts(["a red apple"])
    if ad.trims_text:  # the formula at model.max_text_len: the padded call (tests/test_text_trim.py: trimmed)
        cond = type(cond)(cond.batched)
    x = torch.randn(1, *ad.latent_shape())
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        ad.velocity(x, torch.full((1,), 0.5), cond)
    passes = 2 if cfg.model.adapter in ("wan", "qwen_image") else 1
    assert forward_flops(shape) == pytest.approx(counter.get_total_flops() / passes, rel=0.1)


@pytest.mark.parametrize("name", ["flux_tiny", "wan_tiny", "hunyuan_tiny", "qwen_tiny"])
def test_adapter_cost_hooks_agree_with_the_built_model(name):
    """The class-level hooks the planner reads (no model built) match what the built adapter does:
    its latent shape, and the transformer passes one velocity call makes at and below guidance 1."""
    from digenrl.adapters import adapter_class, build_adapter

    for guidance in (4.5, 1.0):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", [f"sampling.guidance={guidance}"])
        ad = build_adapter(cfg.model, cfg.sampling)
        cls = adapter_class(cfg.model.adapter)
        tcfg, vcfg = cls.presets["tiny"]
        assert cls.latent_shape_for(cfg.model, dict(tcfg), dict(vcfg)) == tuple(ad.latent_shape())
        calls = []
        hook = ad.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
        x = torch.randn(1, *ad.latent_shape())
        with torch.no_grad():
            ad.velocity(x, torch.full((1,), 0.5), ad.encode_prompts(["a red apple"]))
        hook.remove()
        assert len(calls) == cls.guidance_passes(guidance) == Workload.from_config(cfg).passes


def test_memory_model_rejects_what_does_not_fit(tmp_path):
    cfg = load_config(ROOT / "configs" / "qwen_image.yaml")
    w = Workload.from_config(cfg)
    small = cluster_from_dict({"name": "8x4090", "pools": [{"name": "g", "device": "RTX4090", "count": 8}]})
    cost = CostModel(w, small)
    assert not cost.rollout_memory("RTX4090", 1).fits
    assert "RTX4090 needs" in cost.rollout_memory("RTX4090", 1).why
    with pytest.raises(UserError, match="fits no placement"):
        search(cost, small)
    path = tmp_path / "8x4090.yaml"
    path.write_text("pools:\n  - {name: g, device: RTX4090, count: 8}\n")
    result = cli("plan", "-c", str(ROOT / "configs" / "qwen_image.yaml"), "--cluster", str(path))
    assert exit_code(result) == 2
    assert "fits no placement" in str(result.exception)
    # on an H100 the same model fits, with LoRA state and activations accounted for
    big = CostModel(w, load_cluster(CLUSTERS / "16xH100_16xL40S.yaml"))
    setup = big.trainer_setup("H100", 8, False, 1)
    trained = sum(setup.parts[k] for k in ("fp32 masters", "fp32 grads", "AdamW state"))  # 1/shard each
    assert setup.fits and trained * setup.shard == pytest.approx(w.params.lora * 16)


# ------------------------------------------------------------------------------- simulator


class ConstantCost(CostModel):
    """Fixed unit durations and no engine overheads: the closed forms of docs/architecture.md apply."""

    def __init__(self, cfg, rollout=1.0, train=0.5, step=0.1, call=0.0, transfer=0.0, cv=None, replicas=8):
        cluster = cluster_from_dict({"name": "h", "pools": [{"name": "g", "device": "H100", "count": 4}]})
        super().__init__(
            Workload.from_config(cfg),
            cluster,
            CostParams(unit_cv=cv, replicas=replicas),
            overheads=EngineOverheads(call_s=call, transfer_latency_s=0.0, allreduce_latency_s=0.0),
        )
        self.r, self.t, self.s, self.xfer = rollout, train, step, transfer

    def rollout_unit(self, device, groups, setup=None):
        return self.r, 0.0

    def train_unit(self, device, groups, tsp_rank, tsp_degree, setup=None):
        return self.t

    def step(self, device, ranks, publish, setup=None):
        return self.s, 0.0

    def sync_fetch(self, device):
        return 0.0

    def transfer(self, groups):
        return self.xfer

    def switch(self, device, setup):
        return 0.0


def pool(name: str, device: str, count: int) -> PoolConfig:
    return PoolConfig(name=name, device=device, count=count)


def disagg(rollout: int, trainers: int, **knobs) -> Plan:
    return Plan(
        placement="disaggregated",
        pools=(pool("rollout", "H100", rollout), pool("trainer", "H100", trainers)),
        **{"unit_groups": 1, **knobs},
    )


def test_simulator_drives_the_engine_scheduler_and_fills_a_timeline(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.prompts_per_iteration=4", "algorithm.group_size=8")
    cost = ConstantCost(cfg)
    res = simulate(disagg(1, 2, tsp_degree=2, tag=True), cost, iterations=3)
    assert isinstance(res.scheduler, Scheduler) and res.scheduler.done()
    kinds = [type(u) for _, u in res.scheduler.record]
    assert (
        kinds.count(RolloutUnit) == 3 * 4
        and kinds.count(TrainUnit) == 3 * 4 * 2
        and kinds.count(StepUnit) == 3 * 2
    )
    units = {u.uid for _, u in res.scheduler.record}
    recorded = {e.uid for e in res.timeline.events if e.kind in ("rollout", "train", "step")}
    assert recorded == units
    # the same files a real run writes, readable by the same code
    res.save(tmp_path)
    back = Timeline.from_chrome_trace(tmp_path / "timeline.json")
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert [r["samples"] for r in back.iteration_stats()] == [32, 32, 32]
    assert back.iteration_stats()[1]["samples_per_s"] == pytest.approx(
        res.timeline.iteration_stats()[1]["samples_per_s"]
    )


def test_minibatch_ppo_is_simulated_with_the_engines_units(tiny_cfg):
    """train.optimizer_steps 4: the simulator's scheduler is configured exactly as the engine's
    (the resolved layout's), so it hands out the engine's units -- 4 train units per rolled-out
    unit and TSP rank, one per mini-batch, and 4 collective steps per rank and iteration of which
    only the last publishes -- and the bound counts every step."""
    from collections import Counter

    from digenrl.placement.resolve import resolve
    from digenrl.planner.simulator import Simulator

    knobs = [
        *FULL_MODE,
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
        "engine.tsp_degree=2",
        "engine.tag=true",
        "engine.max_staleness=0",
        "train.prompts_per_iteration=4",
        "algorithm.group_size=4",
        "train.iterations=3",
    ]
    cfg, one = tiny_cfg(*knobs, "train.optimizer_steps=4"), tiny_cfg(*knobs)
    plan = disagg(1, 2, tsp_degree=2, tag=True)
    sim = Simulator(plan, ConstantCost(cfg), iterations=3)
    assert sim.sched.cfg == resolve(cfg).scheduler and sim.sched.cfg.optimizer_steps == 4
    sim.run()
    trains = sim.timeline.of("train")
    assert Counter(
        (t.iteration, g, t.args["tsp_rank"], t.args["minibatch"]) for t in trains for g in t.args["groups"]
    ) == Counter({(k, g, r, s): 1 for k in range(3) for g in range(4) for r in range(2) for s in range(4)})
    steps = sim.timeline.of("step")
    assert Counter(e.iteration for e in steps) == Counter({k: 2 * 4 for k in range(3)})
    assert Counter(e.iteration for e in steps if "publishes" in e.args) == Counter({k: 2 for k in range(3)})
    # the bound (train-bound, without TAG: T/t): 4 units x S mini-batches x D ranks' units over 2
    # trainers, plus S steps (ConstantCost's train unit is a fixed 0.5 s, whatever its share)
    r, t, s, plain = 0.1, 0.5, 0.1, disagg(1, 2, tsp_degree=2)
    assert bound(plain, ConstantCost(cfg, r, t, s)) == pytest.approx(4 * 4 * 2 * t / 2 + 4 * s)
    assert bound(plain, ConstantCost(one, r, t, s)) == pytest.approx(4 * 1 * 2 * t / 2 + s)


def test_disaggregated_sync_bubble_is_the_closed_form(tiny_cfg):
    r, t, s, units, R, T = 1.0, 0.5, 0.1, 4, 2, 1
    cost = ConstantCost(tiny_cfg("train.prompts_per_iteration=4"), r, t, s)
    res = simulate(disagg(R, T, gap=False), cost, iterations=3)
    span = units / R * r + units / T * t + s
    busy = units * r + units * t + T * s
    assert res.iteration_s == pytest.approx(span)
    assert res.bubble_fraction == pytest.approx(1 - busy / ((R + T) * span))


def test_balanced_async_reaches_the_design_bound(tiny_cfg):
    cost = ConstantCost(tiny_cfg("train.prompts_per_iteration=4"), 1.0, 1.0, 0.1)
    plan = disagg(1, 1, max_staleness=1)
    res = simulate(plan, cost, iterations=5)
    assert bound(plan, cost) == pytest.approx(max(4 * 1.0, 4 * 1.0 + 0.1))  # max(R/r, T/t)
    assert res.iteration_s == pytest.approx(bound(plan, cost))
    assert res.efficiency == pytest.approx(1.0)
    # with TAG the bound is max(T/t, (R+T)/(r+t)); colocated (R+T)/(r+t)
    assert bound(disagg(1, 1, tag=True), cost) == pytest.approx(max(4.1, 8.1 / 2))
    colocated = Plan(placement="colocated", pools=(pool("g", "H100", 2),))
    assert bound(colocated, cost) == pytest.approx((4 + 4 + 2 * 0.1) / 2)


@pytest.mark.slow  # seconds of planner search or model timing: the full suite runs it
def test_unit_time_spread_makes_a_barrier_wait_for_the_slowest(tiny_cfg):
    # colocated on 2 devices, one rollout and one train unit each per iteration: each phase ends
    # with the slower of two units, the step waits for both
    cfg = tiny_cfg("train.prompts_per_iteration=2")
    plan = Plan(placement="colocated", pools=(pool("g", "H100", 2),))
    r, t, s, c = 1.0, 0.5, 0.1, 0.1
    fixed = simulate(plan, ConstantCost(cfg, r, t, s), iterations=3)
    assert fixed.iteration_s == pytest.approx(r + t + s)
    spread = simulate(plan, ConstantCost(cfg, r, t, s, cv=c, replicas=400), iterations=3)
    # closed form: the larger of two independent N(mu, (c mu)^2) has mean mu (1 + c / sqrt(pi))
    # (the lognormal draws are that normal to O(c^2))
    assert spread.iteration_s == pytest.approx(r + t + s + (r + t) * c / math.sqrt(math.pi), rel=0.01)
    assert spread.bubble_fraction > fixed.bubble_fraction
    again = simulate(plan, ConstantCost(cfg, r, t, s, cv=c, replicas=400), iterations=3)
    assert again.iteration_s == spread.iteration_s  # seeded: a plan's prediction does not move
    # one device alone never waits for another: the spread averages out
    alone = Plan(placement="colocated", pools=(pool("g", "H100", 1),))
    one = simulate(alone, ConstantCost(cfg, r, t, s, cv=c, replicas=400), iterations=3)
    assert one.iteration_s == pytest.approx(2 * (r + t) + s, rel=0.01)


def test_samples_transfer_hides_behind_a_busy_trainer(tiny_cfg):
    cfg = tiny_cfg("train.prompts_per_iteration=4")
    call, xfer = 0.01, 0.3
    for gap in (True, False):  # without GAP every train unit leaves with the iteration's last rollout
        res = simulate(
            disagg(1, 1, gap=gap), ConstantCost(cfg, 0.1, 1.0, 0.0, call=call, transfer=xfer), iterations=3
        )
        ended = {e.uid.split("-", 1)[1]: e.end for e in res.timeline.events if e.kind == "rollout"}
        trains = sorted(
            (e for e in res.timeline.events if e.kind == "train" and e.iteration == 1), key=lambda e: e.start
        )
        first = trains[0]
        samples = ended["1-0"] if gap else max(v for k, v in ended.items() if k.startswith("1-"))
        assert first.start == pytest.approx(samples + xfer + call)
        for before, after in zip(trains, trains[1:]):  # the trainer was busy: only the call is paid
            assert after.start == pytest.approx(before.end + call)


def test_cpu_workers_share_the_host_cores(tiny_cfg):
    cfg = tiny_cfg()
    w = Workload.from_config(cfg)
    plan = Plan(
        placement="disaggregated", pools=(pool("rollout", "cpu", 1), pool("trainer", "cpu", 2)), tsp_degree=2
    )
    fast = simulate(
        plan,
        CostModel(
            w, cluster_from_dict({"pools": [{"name": "c", "device": "cpu", "count": 3}], "host_cores": 3})
        ),
    )
    slow = simulate(
        plan,
        CostModel(
            w, cluster_from_dict({"pools": [{"name": "c", "device": "cpu", "count": 3}], "host_cores": 1})
        ),
    )
    assert slow.iteration_s > 1.5 * fast.iteration_s


def test_colocated_pays_phase_switches(tiny_cfg):
    cfg = load_config(ROOT / "configs" / "flux1_dev.yaml")
    w = Workload.from_config(cfg)
    cluster = load_cluster(CLUSTERS / "16xH800.yaml")
    plan = Plan(placement="colocated", pools=(pool("h800", "H800", 16),), unit_groups=2)
    cheap = CostModel(w, cluster)
    cheap.colocation.switch_latency_s = 0.0
    dear = CostModel(w, cluster)
    dear.colocation.switch_latency_s = 5.0
    gap = simulate(plan, dear).iteration_s - simulate(plan, cheap).iteration_s
    assert gap == pytest.approx(2 * 5.0, rel=0.05)  # two switches per iteration


def test_broadcast_weight_sync_is_paid_where_the_runtime_pays_it(tiny_cfg):
    """engine.weight_sync broadcast (the default): rank 0's step sends the version (pack + wire), the
    rollout worker's unit boundary only loads it from staging; object_store as before (closed forms)."""
    cluster = cluster_from_dict(
        {
            "name": "h",
            "pools": [
                {"name": "rollout", "device": "H100", "count": 2},
                {"name": "trainer", "device": "H100", "count": 1},
            ],
        }
    )
    full = ["model.lora=null", "placement.mode=disaggregated"]  # full weights: a transfer worth seeing
    bc = CostModel(Workload.from_config(tiny_cfg(*full)), cluster)
    store = CostModel(Workload.from_config(tiny_cfg(*full, "engine.weight_sync=object_store")), cluster)
    assert (bc.workload.weight_sync, store.workload.weight_sync) == ("broadcast", "object_store")
    b, h100 = bc.workload.sync_bytes, DEVICES["H100"]
    bw, latency, check = (
        bc.network_bw(),
        cluster.interconnect.latency_us * 1e-6,
        bc.params.checksum_bytes_per_s,
    )
    wire = latency + b / bw
    pack = b / h100.host_bw + b / check  # the weights to the host + one checksum
    assert b > 1e5 and wire > 0
    # rollout critical path: object store = wire + copy + two checksums; broadcast = copy + one check
    assert store.sync_fetch("H100") == pytest.approx(wire + b / h100.host_bw + 2 * b / check)
    assert bc.sync_fetch("H100") == pytest.approx(b / h100.host_bw + b / check)
    # rank 0's publishing step: the broadcast adds the wire there; a step that does not publish is the same
    assert store.step("H100", 1, True)[1] == pytest.approx(pack)
    assert bc.step("H100", 1, True)[1] == pytest.approx(pack + wire)
    assert bc.step("H100", 1, False) == store.step("H100", 1, False)
    # the simulated run records it as the runtime does: rank 0's publish, a prefetch on each rollout
    # worker's row over the same span, and fetches of the staged load's length
    plan = disagg(2, 1, max_staleness=1)
    for cost, prefetches in ((bc, 2), (store, 0)):
        tl = simulate(plan, cost, iterations=3).timeline
        syncs = tl.of("sync")
        publish = {e.version: e for e in syncs if e.args["direction"] == "publish"}
        pre = [e for e in syncs if e.args["direction"] == "prefetch"]
        assert len(pre) == prefetches * len(publish) and {e.worker for e in pre} <= {"rollout0", "rollout1"}
        assert all((e.start, e.end) == (publish[e.version].start, publish[e.version].end) for e in pre)
        fetches = [e for e in syncs if e.args["direction"] == "fetch"]
        assert fetches and all(e.duration == pytest.approx(cost.sync_fetch("H100")) for e in fetches)
        assert {e.args["transport"] for e in syncs} == {cost.workload.weight_sync}


# ---------------------------------------------------------------------------------- search


@pytest.mark.slow  # seconds of planner search or model timing: the full suite runs it
def test_plan_on_a_32_gpu_cluster(tmp_path):
    cfg = load_config(ROOT / "configs" / "flux1_dev.yaml")
    t0 = time.perf_counter()
    cost = CostModel(Workload.from_config(cfg), load_cluster(CLUSTERS / "16xH100_16xL40S.yaml"))
    res = search(cost, cost.cluster, top=5)
    assert time.perf_counter() - t0 < 60
    assert len(res.ranked) >= 5 and res.best_colocated is not None
    sps = [r.samples_per_s for r in res.ranked]
    assert sps == sorted(sps, reverse=True) and sps[0] > 0
    assert res.simulated < res.candidates  # the bound pruned most candidates
    assert all(0 <= r.bubble_fraction < 1 for r in res.ranked)


def test_candidates_cover_the_knobs():
    cluster = load_cluster(CLUSTERS / "8xH800_16xH20.yaml")
    plans = candidates(cluster, 8)
    assert {p.unit_groups for p in plans} == {1, 2, 4, 8}
    assert {p.tsp_degree for p in plans} == {1, 2, 4}
    assert {(p.tag, p.max_staleness) for p in plans if p.placement == "disaggregated"} == {
        (False, 0),
        (False, 1),
        (True, 0),
        (True, 1),
    }
    splits = {
        (p.rollout_pool.device, p.rollout_pool.count, p.trainer_pools[0].device, p.trainer_pools[0].count)
        for p in plans
        if p.placement == "disaggregated"
    }
    assert ("H20", 16, "H800", 8) in splits and ("H800", 3, "H800", 5) in splits


@pytest.mark.slow
def test_plan_cli_json_and_write_then_train_one_iteration(tmp_path, ray_cluster):
    out = tmp_path / "plan.yaml"
    result = cli(
        "plan", "--cluster", str(CLUSTERS / "local_cpu.yaml"), "--top", "3", "--json", "--write", str(out)
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert 0 < len(report["plans"]) <= 3
    assert {"samples_per_s", "bubble_fraction", "speedup_vs_colocated", "engine", "pools"} <= set(
        report["plans"][0]
    )
    cfg = load_config(out)
    assert cfg.placement.mode in ("colocated", "disaggregated") and cfg.train.device == "cpu"
    assert {p.device for p in cfg.cluster.pools} == {"cpu"}
    run_dir = tmp_path / "run"
    result = cli(
        "train",
        "-c",
        str(out),
        "--set",
        "train.iterations=1",
        *as_sets(TINY_IMAGE),
        "--set",
        "output.tensorboard=false",
        "--run-dir",
        str(run_dir),
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["samples_per_s"] > 0
    assert (run_dir / "timeline.json").is_file()


@pytest.mark.slow  # seconds of planner search or model timing: the full suite runs it
def test_plan_table_output():
    result = cli(
        "plan",
        "-c",
        str(ROOT / "configs" / "wan2.1_t2v_14b.yaml"),
        "--cluster",
        str(CLUSTERS / "8xH800_16xH20.yaml"),
        "--top",
        "2",
    )
    assert result.exit_code == 0, result.output
    assert "samples/s" in result.output and "vs col." in result.output
    assert "predictions" in result.output
    # the report says what it predicts (issue 26): throughput, not reward per wall-second
    assert "predict samples per second, not learning" in " ".join(result.output.split())


def test_plan_without_a_cluster_uses_the_configs_typed_pools_or_says_what_is_missing():
    result = cli("plan", "-c", str(ROOT / "configs" / "qwen_image.yaml"), "--json", "--top", "1")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["cluster"]["devices"] == {"H20": 4, "H800": 4}


def test_known_gpu_table_has_datasheet_numbers():
    assert DEVICES["H100"].bf16_flops == pytest.approx(989.5e12)
    assert DEVICES["H20"].memory == pytest.approx(96e9)
    assert DEVICES["A100"].mem_bw == pytest.approx(2.039e12)
    assert {"H100", "H200", "H800", "H20", "A100", "L40S", "RTX4090"} <= set(DEVICES)


# ------------------------------------------------------------------- plan: --iterations, --timeline, --ladder


def test_plan_ladder_timeline_and_iterations(monkeypatch, capsys, tmp_path):
    code, out, err = cli_main(
        monkeypatch,
        capsys,
        "plan",
        "--cluster",
        str(CLUSTERS / "local_cpu.yaml"),
        "--json",
        "--top",
        "1",
        "--iterations",
        "3",
        "--ladder",
        "--timeline",
        str(tmp_path / "tl"),
    )
    assert code in (0, None), err
    report = json.loads(out)
    steps = [row["step"] for row in report["ladder"]]
    assert steps == ["sync", "+GAP", "+TSP", "+TAG", "+async"]
    assert report["ladder"][0]["gain_vs_previous"] is None
    sps = [row["samples_per_s"] for row in report["ladder"]]
    for row, before in zip(report["ladder"][1:], sps):
        # each step searches a superset of the previous one's plans: never worse (up to simulation ties)
        assert row["gain_vs_previous"] == pytest.approx(row["samples_per_s"] / before)
        assert row["samples_per_s"] >= before * 0.999
    for name in ("best", "colocated"):
        assert (tmp_path / "tl" / name / "timeline.json").is_file() and (
            tmp_path / "tl" / name / "timeline.png"
        ).is_file()
    tl = Timeline.from_chrome_trace(tmp_path / "tl" / "best" / "timeline.json")
    assert len(tl.iteration_spans()) == 3
    # the table form prints the ladder as its own table
    code, out, err = cli_main(
        monkeypatch, capsys, "plan", "--cluster", str(CLUSTERS / "local_cpu.yaml"), "--top", "1", "--ladder"
    )
    assert code in (0, None), err
    assert "what each knob adds" in out and "+async" in out and "vs previous" in out


@pytest.mark.parametrize(
    "argv, option",
    [
        (["plan", "--iterations", "0"], "--iterations"),
        (["plan", "--top", "0"], "--top"),
        (["profile", "--engine", "fast"], "--engine"),
        (["profile", "--repeats", "0"], "--repeats"),
        (["profile", "--device", "tpu"], "--device"),
    ],
)
def test_plan_and_profile_bad_options_exit_2_naming_the_option(monkeypatch, capsys, argv, option):
    code, out, err = cli_main(monkeypatch, capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and option in lines[0], err


def test_plan_timeline_that_is_a_file_exits_2(monkeypatch, capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    code, out, err = cli_main(
        monkeypatch,
        capsys,
        "plan",
        "--cluster",
        str(CLUSTERS / "local_cpu.yaml"),
        "--timeline",
        str(tmp_path / "f"),
    )
    assert code == 2 and "--timeline" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- sub-group units and baselines


class ProportionalCost(ConstantCost):
    """Unit times proportional to the groups a unit holds (a half group takes half the time)."""

    def rollout_unit(self, device, groups, setup=None):
        return self.r * groups, 0.0

    def train_unit(self, device, groups, tsp_rank, tsp_degree, setup=None):
        return self.t * groups


def test_spread_units_gives_every_device_a_unit():
    from digenrl.placement.plan import spread_units

    assert spread_units(32, 4, 16, 16) == (2, 1)  # enough groups: smaller units of whole groups
    assert spread_units(8, 1, 16, 2) == (1, 1)  # already covered: unchanged
    assert spread_units(4, 1, 24, 16) == (1, 4)  # HunyuanVideo's 4 x 24 on 16 devices: quarter groups
    assert spread_units(4, 2, 24, 32) == (1, 8)
    assert spread_units(1, 1, 4, 16) == (1, 4)  # at most one sample per unit


def test_colocated_plan_of_a_run_config_splits_groups_fewer_than_devices(tiny_cfg):
    pools = "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 2}]"
    cfg = tiny_cfg(
        "placement.mode=colocated",
        "engine.max_staleness=0",
        "train.prompts_per_iteration=1",
        "algorithm.group_size=8",
        pools,
    )
    plan = Plan.from_run_config(cfg)
    assert (plan.unit_groups, plan.group_parts) == (1, 4) and plan.scheduler_config(
        1, 1
    ).units_per_iteration == 4
    pinned = Plan.from_run_config(
        tiny_cfg(
            "placement.mode=colocated",
            "train.prompts_per_iteration=1",
            "algorithm.group_size=8",
            "engine.unit_samples=8",
            pools,
        )
    )
    assert pinned.group_parts == 1  # an explicit engine.unit_samples is kept
    disagg_plan = Plan.from_run_config(
        tiny_cfg(*FULL_MODE, "train.prompts_per_iteration=1", "algorithm.group_size=8", pools)
    )
    assert disagg_plan.group_parts == 1  # only colocated spreads by itself


def test_sub_group_units_keep_every_colocated_device_busy(tiny_cfg):
    """One group on 4 colocated devices: whole-group units leave 3 idle (r + t + s per iteration), quarter
    groups spread it (r/4 + t/4 + s), and every device rolls out."""
    cost = ProportionalCost(
        tiny_cfg("train.prompts_per_iteration=1", "algorithm.group_size=8"), 1.0, 0.5, 0.1
    )
    devices = (pool("g", "H100", 4),)
    whole = simulate(Plan(placement="colocated", pools=devices), cost, iterations=3)
    split = simulate(Plan(placement="colocated", pools=devices, group_parts=4), cost, iterations=3)
    assert whole.iteration_s == pytest.approx(1.0 + 0.5 + 0.1)
    assert split.iteration_s == pytest.approx(0.25 + 0.125 + 0.1)
    assert {e.worker for e in split.timeline.of("rollout")} == {"g0", "g1", "g2", "g3"}
    assert (
        split.timeline.iteration_stats()[1]["samples"] == whole.timeline.iteration_stats()[1]["samples"] == 8
    )


def test_baselines_include_spread_colocation_and_separate_async():
    """HunyuanVideo's 4 prompts x 24 on 16 H800s: the colocated baseline spreads samples over all 16 devices
    and beats the earlier whole-group baseline; separate_async is disaggregated one-step-off without GAP,
    TSP or TAG."""
    from digenrl.planner.search import baselines

    cfg = load_config(ROOT / "configs" / "hunyuan_video.yaml")
    cluster = load_cluster(CLUSTERS / "16xH800.yaml")
    peers = baselines(CostModel(Workload.from_config(cfg), cluster), cluster, sp=(1,))  # one GPU per worker
    col, whole, sep = peers["colocated"], peers["colocated_whole_groups"], peers["separate_async"]
    assert col.plan.group_parts > 1 and whole.plan.group_parts == 1
    assert col.samples_per_s > whole.samples_per_s
    assert {e.worker for e in col.timeline.of("rollout")} == {w.name for w in col.plan.workers()}
    p = sep.plan
    assert (p.placement, p.gap, p.tsp_degree, p.tag, p.max_staleness) == ("disaggregated", False, 1, False, 1)


def test_plan_report_lists_the_baselines(monkeypatch, capsys):
    code, out, err = cli_main(
        monkeypatch,
        capsys,
        "plan",
        "-c",
        str(ROOT / "configs" / "hunyuan_video.yaml"),
        "--cluster",
        str(CLUSTERS / "16xH800.yaml"),
        "--top",
        "1",
        "--json",
    )
    assert code in (0, None), err
    report = json.loads(out)
    assert set(report["baselines"]) == {"colocated", "colocated_whole_groups", "separate_async"}
    best = report["plans"][0]["samples_per_s"]
    for row in report["baselines"].values():
        assert row["best_speedup"] == pytest.approx(best / row["samples_per_s"])
        # the engine runs every arrangement of the peers, so the search held it too: never faster
        assert row["best_speedup"] >= 1 - 1e-9


def test_the_ranks_agreement_after_a_step_is_an_on_device_pass_not_a_host_copy():
    """FLUX.1-dev r64 on an H800: the trainer ranks' digest streams the LoRA bytes 7 times at the
    device's bandwidth and launches 16 kernels per tensor (684 tensors, 2 per matched linear), where
    the host copy + SHA-256 the engine ran before cost 0.79 s (PCIe + one core at the SHA-256 rate
    measured on an H200 host)."""
    from digenrl.planner.workload import Workload

    w = Workload.from_config(load_config(Path("configs/flux1_dev.yaml")))
    t = AnalyticTimes(w, DEVICES["H800"], CostParams())
    assert w.params.lora_tensors == 684
    by_hand = 7 * w.sync_bytes / (DEVICES["H800"].mem_bw * 0.70) + 16 * 5e-6 * 684
    assert t.agree() == pytest.approx(by_hand)
    assert t.pack() == pytest.approx(w.sync_bytes / DEVICES["H800"].host_bw + w.sync_bytes / 0.92e9)
    assert t.agree() < t.pack() / 5


def test_the_gpu_checks_numbers_are_the_planners_and_the_calibration_stays_below_the_kernels():
    """The defaults folded from the first GPU run equal what fold_gpu_check.py read from its files;
    the calibrated (effective) Hopper efficiencies are at most the kernels' measured on an H200."""
    from digenrl.planner.gpus import KERNEL_EFFICIENCY, MEASURED_KERNEL_EFFICIENCY
    from digenrl.planner.params import CostParams

    run = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_runs" / "2026-12-04-h200"
    fold = json.loads((run / "fold.json").read_text())
    assert fold["applies"] and fold["gpu"] == "H200"
    measured = {d["name"]: d["measured"] for d in fold["defaults"]}
    sampling, training = MEASURED_KERNEL_EFFICIENCY["H200"]
    assert sampling == round(measured["sampling peak efficiency"], 3)
    assert training == round(measured["training peak efficiency"], 3)
    assert all(k <= m for k, m in zip(KERNEL_EFFICIENCY["H200"], MEASURED_KERNEL_EFFICIENCY["H200"]))
    p = CostParams()
    assert p.model_reward_overlap == round(measured["model reward overlap"], 3)
    assert p.model_reward_params == pytest.approx(measured["model reward parameters"], rel=1e-3)
