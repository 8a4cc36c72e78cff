"""The memory model and the planner with sequence parallelism and the CFG mode (docs/scaling.md, "Memory
model"): per-device activations scale 1/sp for the sequence (video-token) part only; batched CFG holds two
passes; the planner tries sp degrees for video models and ``plan --write`` writes them; the real-scale
video configs pass their memory preflight."""

from __future__ import annotations

from pathlib import Path

import pytest

from digenrl.config.run import load_config
from digenrl.errors import UserError
from digenrl.placement.plan import Plan, apply_plan
from digenrl.placement.preflight import check_memory, resolve_cfg_batching, resolve_memory_settings
from digenrl.planner.bound import bound
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import load_cluster
from digenrl.planner.memory import MemoryModel
from digenrl.planner.params import CostParams
from digenrl.planner.search import candidates, sp_degrees
from digenrl.planner.simulator import simulate
from digenrl.planner.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ROOT / "configs" / "clusters"
WAN = ROOT / "configs" / "wan2.1_t2v_14b.yaml"  # 480p x 81
WAN_240P = ROOT / "configs" / "wan2.1_t2v_14b_240p.yaml"
HUNYUAN = ROOT / "configs" / "hunyuan_video.yaml"
VIDEO = [WAN, WAN_240P, HUNYUAN]
# Wan 480p colocated on 16 H800, and disaggregated on two pools of 8 H800
COLOCATED = [
    "cluster.pools=[{name: h800, device: H800, count: 16}]",
    "placement.mode=colocated",
    "placement.rollout_pool=h800",
    "placement.trainer_pool=h800",
    "engine.max_staleness=0",  # the shipped config is one-step async; colocated runs on-policy
]
DISAGG = [
    "cluster.pools=[{name: rollout, device: H800, count: 8}, {name: trainer, device: H800, count: 8}]",
    "placement.mode=disaggregated",
    "placement.rollout_pool=rollout",
    "placement.trainer_pool=trainer",
    "engine.rollout_sp=2",
    "engine.trainer_sp=2",
]


def model(path, *overrides) -> MemoryModel:
    return MemoryModel(Workload.from_config(load_config(path, list(overrides))), CostParams())


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_activations_per_device_scale_one_over_sp_for_the_sequence_part(sp):
    m = model(WAN)
    t, h, blocks = m.workload.shape.tokens, m.workload.params.hidden, m.workload.params.blocks
    # the sequence part (video tokens) divides by sp; the text tokens (cross-attention) stay whole
    for ckpt in (False, True):
        one, many = m.train_acts(1, ckpt, 1), m.train_acts(1, ckpt, sp)
        text_part = m.train_acts(1, ckpt, 1) * t.text / (t.x + t.text)
        assert many == pytest.approx((one - text_part) / sp + text_part, rel=1e-12)
    assert m.block_input_bytes(sp) == (t.x / sp + t.text) * h * 2
    # rollout: only the live-activation term scales; weights, trajectory and decode do not
    r1, rs = m.rollout_parts(1, 1), m.rollout_parts(1, sp)
    assert r1["weights"] == rs["weights"] and r1["rollout models"] == rs["rollout models"]

    def acts(s):
        return m.held_passes(True) * m.workload.group_size * m.pass_tokens(s) * h * m.params.infer_act_bytes

    assert r1["activations"] - rs["activations"] == pytest.approx(acts(1) - acts(sp), rel=1e-9)
    # the sharded parts shard over FSDP ranks, never over the sp devices of a rank
    assert m.train_parts(2, 1, True, sp)["frozen base"] == m.train_parts(2, 1, True, 1)["frozen base"]
    assert blocks == 40


def test_batched_cfg_holds_both_passes():
    m = model(WAN)
    assert m.workload.passes == 2
    for ckpt in (False, True):
        assert m.train_acts(1, ckpt, cfg_batched=True) == 2 * m.train_acts(1, ckpt, cfg_batched=False)
    one_pass = model(HUNYUAN)  # embedded guidance: one pass, nothing to choose
    assert one_pass.workload.passes == 1 and one_pass.cfg_modes("auto") == (True,)


def test_rollout_auto_falls_back_to_sequential_cfg_where_batched_does_not_fit():
    m = model(WAN)
    have = m.have("H800")
    groups = next(g for g in range(1, 64) if sum(m.rollout_parts(g, 1, True).values()) > have)
    assert sum(m.rollout_parts(groups, 1, False).values()) <= have  # sequential still fits here
    s = m.rollout("H800", groups)
    assert s.fits and not s.cfg_batched
    assert not m.rollout("H800", groups, cfg="batched").fits
    assert m.rollout("H800", 1, sp=4).cfg_batched  # a quarter of the tokens per device: batched fits


@pytest.mark.parametrize("path", VIDEO, ids=lambda p: p.name)
def test_real_scale_video_configs_pass_the_memory_preflight(path):
    cfg = load_config(path, [])
    check_memory(cfg)  # the runtime's own preflight, on the config as shipped (no GPU needed)
    s = resolve_memory_settings(cfg)
    assert s.device and 0 < s.need_bytes <= s.have_bytes
    plan = Plan.from_run_config(cfg)
    assert plan.rollout_sp == cfg.engine.rollout_sp and plan.trainer_sp == cfg.engine.trainer_sp


@pytest.mark.parametrize("path", VIDEO, ids=lambda p: p.name)
def test_real_scale_video_configs_are_runnable_as_shipped(path):
    """`digenrl config validate`'s engine checks, without Ray or a GPU: the runtime's own refusals of
    sequence parallelism and sharding, the engine's workers and schedule -- its resolved layout. The
    planner proposes only what these accept (search.refused_plan)."""
    from digenrl.placement.resolve import resolve

    cfg = load_config(path, [])
    check_memory(cfg)
    layout = resolve(cfg)
    assert len(layout.workers) == sum(p.count for p in cfg.cluster.pools)
    assert layout.scheduler is not None


def test_480p_needs_what_the_config_sets():
    """Wan 480p x 81 trains only with its memory settings: without sequence parallelism the same
    placement does not fit, and the error names a setting."""
    cfg = load_config(WAN, [])
    assert cfg.engine.trainer_sp > 1 or cfg.train.activation_checkpointing == "on"
    with pytest.raises(UserError):
        check_memory(
            load_config(
                WAN,
                [
                    "engine.trainer_sp=1",
                    "engine.rollout_sp=1",
                    "train.activation_checkpointing=off",
                    "sampling.cfg_batching=batched",
                ],
            )
        )


def test_an_sp_degree_that_does_not_divide_the_pool_is_one_line():
    with pytest.raises(
        UserError, match=r"^engine.trainer_sp: 3 does not divide pool 'h800' \(16 x H800\): a worker"
    ):
        Plan.from_run_config(load_config(WAN, [*COLOCATED, "engine.trainer_sp=3", "engine.rollout_sp=3"]))
    with pytest.raises(UserError, match=r"^engine.rollout_sp: 3 does not divide pool 'rollout' \(8 x H800\)"):
        Plan.from_run_config(load_config(WAN, [*DISAGG, "engine.rollout_sp=3"]))
    with pytest.raises(UserError, match=r"^engine.rollout_sp: 4: a colocated worker rolls out and trains"):
        Plan.from_run_config(load_config(WAN, [*COLOCATED, "engine.rollout_sp=4"]))


def test_planner_tries_sp_degrees_for_video_models_only():
    cluster = load_cluster(CLUSTERS / "16xH800.yaml")
    video = CostModel(Workload.from_config(load_config(WAN)), cluster)
    image = CostModel(Workload.from_config(load_config(ROOT / "configs" / "flux1_dev.yaml")), cluster)
    assert sp_degrees(video, cluster) == (1, 2, 4, 8) and sp_degrees(image, cluster) == (1,)
    plans = candidates(cluster, 4, group_size=4, sp=(1, 2, 4))
    assert {(p.rollout_sp, p.trainer_sp) for p in plans if p.placement == "disaggregated"} >= {
        (1, 1),
        (2, 4),
        (4, 2),
    }
    assert all(p.rollout_sp == p.trainer_sp for p in plans if p.placement == "colocated")
    # every plan's pools split into whole workers; units and TSP count workers
    for p in plans:
        assert all(pool.count % p.sp(pool) == 0 for pool in p.pools)
        assert p.tsp_degree <= p.ranks


def test_sp_workers_and_speed_in_the_simulator():
    cluster = load_cluster(CLUSTERS / "16xH800.yaml")
    cost = CostModel(Workload.from_config(load_config(WAN)), cluster)
    pools = (
        cluster.pools[0].model_copy(update={"name": "rollout", "count": 8}),
        cluster.pools[0].model_copy(update={"name": "trainer", "count": 8}),
    )
    one = Plan(placement="disaggregated", pools=pools, tsp_degree=1, rollout_sp=1, trainer_sp=2)
    two = Plan(placement="disaggregated", pools=pools, tsp_degree=1, rollout_sp=2, trainer_sp=2)
    assert len(two.leads()) == 4 + 4 and len(one.leads()) == 8 + 4 and two.ranks == 4
    s1 = cost.rollout_memory("H800", 1, 1)
    s2 = cost.rollout_memory("H800", 1, 2)
    t1, t2 = cost.rollout_unit("H800", 1, s1)[0], cost.rollout_unit("H800", 1, s2)[0]
    assert t1 / 2 < t2 < t1  # half the tokens per device, plus the all-to-alls and the unsplit decode
    r = simulate(two, cost, iterations=2)
    assert r.samples_per_s > 0 and bound(two, cost) <= r.iteration_s * (1 + 1e-9)
    assert {e.worker for e in r.timeline.events} == {w.name for w in two.leads()}  # the leads only


def test_plan_write_sets_the_sp_keys():
    cfg = load_config(WAN, DISAGG)
    plan = Plan(placement="disaggregated", pools=tuple(cfg.cluster.pools), rollout_sp=2, trainer_sp=4)
    out = apply_plan(cfg, plan, "cuda")
    assert (out.engine.rollout_sp, out.engine.trainer_sp) == (2, 4)
    assert Plan.from_run_config(out).leads() == plan.leads()


def test_cfg_auto_is_what_the_memory_model_says():
    cfg = load_config(WAN, [*DISAGG, "sampling.cfg_batching=auto"])
    m = MemoryModel(Workload.from_config(cfg), CostParams())
    plan = Plan.from_run_config(cfg)
    rollout = m.rollout(plan.rollout_pool.device, plan.unit_size, plan.rollout_sp)
    assert resolve_cfg_batching(cfg, False) == ("batched" if rollout.cfg_batched else "sequential")
    assert resolve_cfg_batching(cfg, True) == (
        "batched" if resolve_memory_settings(cfg).cfg_batched else "sequential"
    )


def test_batched_cfg_that_does_not_fit_a_rollout_gpu_names_the_key():
    """The one line names sampling.cfg_batching when sequential passes would fit the same unit."""
    m = model(WAN)
    plan = Plan.from_run_config(load_config(WAN, DISAGG))
    device, sp = plan.rollout_pool.device, plan.rollout_sp
    g = next(g for g in range(1, 65) if not m.rollout(device, g, sp, "batched").fits)
    assert m.rollout(device, g, sp, "sequential").fits
    over = [
        *DISAGG,
        "sampling.cfg_batching=batched",
        f"engine.unit_groups={g}",
        f"train.prompts_per_iteration={g}",
        "engine.rollout_batch=trainer",  # a forward may hold the whole unit (auto would shrink the batch)
    ]
    with pytest.raises(UserError) as exc:
        check_memory(load_config(WAN, over))
    line = str(exc.value)
    assert line.startswith("sampling.cfg_batching: pool 'rollout'") and "\n" not in line
    assert line.endswith("set sampling.cfg_batching: sequential (or auto)")
    check_memory(load_config(WAN, [*over, "sampling.cfg_batching=sequential"]))  # the fix fits


def test_plan_config_writes_what_the_plan_assumes():
    """What `plan --write` writes for a video model: the sp degrees, the CFG mode and the memory settings
    the chosen plan was sized with -- and it passes the memory preflight as written."""
    from digenrl.cli.plan import plan_config
    from digenrl.planner.search import search

    cfg = load_config(WAN)
    cluster = load_cluster(CLUSTERS / "16xH800.yaml")
    best = search(CostModel(Workload.from_config(cfg), cluster), cluster, top=1).ranked[0]
    out = plan_config(cfg, best, cluster)
    assert (out.engine.rollout_sp, out.engine.trainer_sp) == (best.plan.rollout_sp, best.plan.trainer_sp)
    modes = {s.cfg_batched for s in best.setups.values()}
    assert out.sampling.cfg_batching == (
        "auto" if len(modes) > 1 else "batched" if modes == {True} else "sequential"
    )
    check_memory(out)


@pytest.mark.slow  # seconds of planner search or model timing: the full suite runs it
@pytest.mark.parametrize(
    "path, evaluates",
    [(WAN, False), (WAN_240P, True), (HUNYUAN, False)],
    ids=["wan-480p", "wan-240p-eval", "hunyuan"],
)
def test_the_search_proposes_only_what_the_runtime_runs(path, evaluates):
    """Every ranked plan, written as a config, passes the runtime's own refusals (its layout
    resolves), colocated sequence-parallel ones included; the peers' colocated baseline is one the
    engine runs too."""
    from digenrl.cli.plan import plan_config
    from digenrl.placement.resolve import resolve
    from digenrl.planner.search import baselines, refused_plan, search

    cfg = load_config(path, [f"output.eval_every={10 if evaluates else 0}"])
    cluster = load_cluster(CLUSTERS / "16xH800.yaml")
    cost = CostModel(Workload.from_config(cfg), cluster)
    result = search(cost, cluster, top=5)
    assert result.ranked
    for r in result.ranked:
        out = plan_config(cfg, r, cluster)
        resolve(out)

    def uneven(why):  # the refusals left: a degree the model's tokens / heads or a unit cannot split over,
        # or a shard group wider than a node (HSDP's to split: settings.node_refusal)
        return any(w in why for w in ("split evenly", "divide", "split over", "fit one node"))

    assert all(uneven(why) for why, _ in result.rejected.values() if "engine refuses" in why)
    peer = baselines(cost, cluster)["colocated"]  # the peers' colocated SP arrangement: one the engine runs
    if peer is not None:
        why = refused_plan(peer.plan, peer.setups, cost)
        assert not why or uneven(why)


def test_sharding_degrees_count_trainer_devices_as_the_runtime_does():
    """``train.fsdp: N`` with ``engine.trainer_sp: s``: FSDP over shard groups of N trainer devices that
    hold whole SP groups (HSDP when N is below the devices; settings.fsdp_refusal refuses an N that
    splits an SP group), so ``auto`` offers 1 and the multiples of s dividing the devices, and a
    device holds 1/N of the base weights."""
    m = model(WAN)
    ranks, sp = 4, 2  # 8 trainer devices
    options = {shard for *_, shard in m.options(ranks * sp, sp=sp)}
    assert options == {1, 2, 4, 8}  # SP pairs inside shard groups of 2, 4 (HSDP) or 8
    assert {shard for *_, shard in m.options(8, sp=4)} == {1, 4, 8}  # never 2: it would split an SP group
    for shard in (2, ranks * sp):  # HSDP or one shard group: 1/N of the base weights each
        parts = m.trainer_need(shard, 1, True, sp=sp)
        w = m.workload
        assert parts["frozen base"] == pytest.approx(w.params.total * w.dtype_bytes / shard)
    fits, miss = m.setups("H800", ranks, False, 1, sp)
    assert {s.shard for s in fits} | {miss.shard} <= {1, 2, 4, ranks * sp}
