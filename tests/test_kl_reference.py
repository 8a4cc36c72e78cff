"""``algorithm.kl_reference: rollout``: the sampler computes the KL reference's step mean at each
sample's trained steps (LoRA off) and the samples carry it; the trainer reads it instead of running a
reference forward. Checked against the trainer's own reference forward (``train``) and against a
one-row forward per (sample, step); a local run of 2 iterations equal to ``train``'s; the engine (full
mode, colocated) with no reference forward on its trainer ranks; the refusals; ``auto``'s resolution."""

from __future__ import annotations

import math

import pytest
import torch

from digenrl.algorithms import grpo
from digenrl.algorithms.sde import noise_std, step_mean
from digenrl.config.run import load_config
from digenrl.data.prompts import PromptSampler, load_prompts
from digenrl.errors import UserError
from digenrl.placement.resolve import resolve
from digenrl.policy.model import Policy
from digenrl.units import train as units_train
from digenrl.units.advantages import assign_advantages
from digenrl.units.rollout import rollout_unit
from tests.helpers import TINY

#: a KL term, 2 prompts x 4 samples of 4 steps, micro-batches of 2 (several reference forwards per step);
#: the tests add DanceGRPO's per-sample trained steps where the means' indexing by position matters
KL = [*TINY, "algorithm.kl_beta=0.04", "train.micro_batch=2"]
KL_TO_REFERENCE = grpo.kl_to_reference
H800 = "cluster.pools=[{name: rollout, device: H800, count: 2}, {name: trainer, device: H800, count: 2}]"


def perturbed_policy(cfg) -> Policy:
    """A policy whose LoRA is not zero (at initialisation the policy IS the reference: KL 0)."""
    torch.manual_seed(cfg.train.seed)
    policy = Policy(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in policy.adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return policy


def unit_of(policy, batch=None):
    cfg = policy.cfg
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(0, 2)
    samples, _ = rollout_unit(policy, prompts, [0, 1], 0, cfg.train.seed, batch=batch)
    samples.rewards = torch.arange(len(samples), dtype=torch.float32)
    assign_advantages([samples], cfg)
    return samples


def trainer_references(policy, samples, monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(mu, mu_ref) of every KL term the train unit computes, in order (its gradients zeroed after)."""
    seen = []
    real = KL_TO_REFERENCE

    def spy(mu, mu_ref, std):
        seen.append((mu.detach().clone(), mu_ref.detach().clone()))
        return real(mu, mu_ref, std)

    monkeypatch.setattr(grpo, "kl_to_reference", spy)
    terms = len(samples) * samples.train_idx.shape[1]
    stats = units_train.train_unit(policy, samples, terms)
    policy.optimizer.zero_grad(set_to_none=True)
    return seen, stats


@pytest.mark.parametrize("name", ["flow_grpo", "dance_grpo"])
def test_the_shipped_reference_equals_the_trainers_reference_forward(name, monkeypatch):
    """Rolled out in the train forwards' batches (the CPU default), the reference forward at rollout
    runs on the very rows the trainer's would: the same numbers, bit for bit."""
    cfg = load_config(None, [*KL, f"algorithm.name={name}", "algorithm.kl_reference=rollout"])
    policy = perturbed_policy(cfg)
    assert policy.settings.kl_reference == "rollout"
    samples = unit_of(policy)
    assert samples.ref_means is not None and samples.ref_means.shape[:2] == samples.train_idx.shape
    assert samples.timings["ref_forwards"] > 0
    shipped, st_ship = trainer_references(policy, samples, monkeypatch)
    samples.ref_means = None  # the trainer's own reference forward (kl_reference: train)
    recomputed, st_train = trainer_references(policy, samples, monkeypatch)
    assert len(shipped) == len(recomputed) == st_train["ref_forwards"] > 0
    assert st_ship["ref_forwards"] == 0
    for (mu_a, ref_a), (mu_b, ref_b) in zip(shipped, recomputed):
        torch.testing.assert_close(mu_a, mu_b, atol=0, rtol=0)
        torch.testing.assert_close(ref_a, ref_b, atol=0, rtol=0)
        assert (mu_a - ref_a).abs().max() > 1e-4  # not vacuous: the reference is another network
    assert st_ship["kl"] == st_train["kl"] > 0


def test_the_shipped_reference_equals_a_one_row_reference_forward():
    """An independent reference: per (sample, trained step), one forward of that row alone with the
    LoRA off and the step mean of docs/algorithms.md. A colocated batch of 3 (other rows per forward
    than the trainer's) agrees to float rounding: 1e-5 on latents of O(1) (a different batch
    composition reorders the matmuls' sums; bit-exact only in the trainer's batches, test above)."""
    cfg = load_config(None, [*KL, "algorithm.name=dance_grpo", "algorithm.kl_reference=rollout"])
    policy = perturbed_policy(cfg)
    ad, kind, eta = policy.adapter, cfg.sampling.sde, cfg.sampling.noise_level
    for batch in (None, 3):
        samples = unit_of(policy, batch)
        sig = samples.sigmas
        for r in range(len(samples)):
            for j, i in enumerate(samples.train_idx[r].tolist()):
                x = samples.latents[r : r + 1, i]
                with torch.no_grad(), policy.reference():
                    v = ad.velocity(x, sig[i].expand(1), samples.cond.select(torch.tensor([r])))
                want = step_mean(kind, x, v, float(sig[i]), float(sig[i + 1]), noise_std(kind, sig, i, eta))
                torch.testing.assert_close(samples.ref_means[r : r + 1, j], want, atol=1e-5, rtol=0)


def test_a_local_run_with_the_reference_at_rollout_equals_train():
    """Two iterations of the local trainer, kl_reference rollout vs train: the KL, the loss and the LoRA
    weights after them equal (bit for bit on the CPU: the same rows per reference forward)."""
    from digenrl.engine.local import LocalTrainer

    runs = {}
    for where in ("train", "rollout"):
        cfg = load_config(None, [*KL, "placement.mode=local", f"algorithm.kl_reference={where}"])
        trainer = LocalTrainer(cfg)
        assert trainer.policy.settings.kl_reference == where
        rows = [trainer.iteration(k) for k in range(2)]
        runs[where] = rows, trainer.policy.weights()
    (rows_t, w_t), (rows_r, w_r) = runs["train"], runs["rollout"]
    assert rows_t[1]["kl"] > 0  # after one step the policy has left the reference
    for a, b in zip(rows_t, rows_r):
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-6, abs=1e-12)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-12)
    assert w_t.keys() == w_r.keys()
    for k in w_t:
        torch.testing.assert_close(w_r[k], w_t[k], atol=1e-7, rtol=0)
    assert any(w_t[k].abs().max() > 0 for k in w_t if "lora_B" in k)  # the run moved the weights


@pytest.mark.parametrize(
    "sets, field",
    [
        (["model.lora=null"], "needs LoRA"),
        (["algorithm.name=diffusion_nft"], "diffusion_nft"),
        (["algorithm.name=awm"], "awm"),
        (["algorithm.name=online_dpo"], "online_dpo"),
        (["algorithm.shared_prefix=1"], "shared_prefix"),
    ],
)
def test_rollout_is_refused_where_it_cannot_run(sets, field):
    with pytest.raises(UserError, match=f"algorithm.kl_reference: rollout .*{field}") as exc:
        load_config(None, [*KL, "algorithm.kl_reference=rollout", *sets])
    assert "\n" not in str(exc.value)


def test_auto_resolves_once_into_the_layout():
    """auto: rollout on GPU pools (LoRA, a Flow-GRPO-family loss), train on CPU pools and locally."""
    colo = [*KL, "placement.mode=colocated"]
    assert resolve(load_config(None, colo)).settings.kl_reference == "train"  # CPU pools
    on_gpu = resolve(load_config(None, [*colo, H800]))
    assert on_gpu.settings.kl_reference == "rollout"
    assert any("KL reference rollout" in line for line in on_gpu.describe())
    for sets in (["algorithm.kl_reference=train"], ["model.lora=null"], ["algorithm.name=awm"]):
        assert resolve(load_config(None, [*colo, H800, *sets])).settings.kl_reference == "train"
    no_kl = resolve(load_config(None, [*colo, H800, "algorithm.kl_beta=0"]))
    assert no_kl.settings.kl_reference == "train"  # no KL term: no reference anywhere
    local = resolve(load_config(None, [*KL, "placement.mode=local"]))
    assert local.settings.kl_reference == "train"
    pinned = resolve(load_config(None, [*colo, "algorithm.kl_reference=rollout"]))
    assert pinned.settings.kl_reference == "rollout"  # explicit: on CPU pools too


def test_the_samples_carry_no_reference_by_default():
    cfg = load_config(None, KL)
    samples = unit_of(perturbed_policy(cfg))
    assert samples.ref_means is None and samples.timings["ref_forwards"] == 0
    assert math.isfinite(float(samples.log_probs.sum()))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "full_mode", "colocated_train"])
def test_the_engine_runs_no_reference_forward_on_its_trainer_ranks(mode, ray_cluster, tmp_path):
    """Two iterations on the engine (colocated; the full mode: disaggregated + GAP + TSP 2 + TAG +
    one-step async) with kl_reference rollout: every rollout unit ran reference forwards, no train
    unit did (the timeline's ``ref_forwards``); ``colocated_train``: the control, the other way round."""
    from digenrl.engine.timeline import Timeline
    from digenrl.launch import run_engine
    from tests.helpers import FULL_MODE, QUIET, assert_timeline_invariants

    where = "train" if mode == "colocated_train" else "rollout"
    sets = FULL_MODE if mode == "full_mode" else ["placement.mode=colocated"]
    base = [*KL, *QUIET, "train.iterations=2", "output.checkpoint_every=0"]
    cfg = load_config(None, [*base, f"algorithm.kl_reference={where}", *sets])
    result = run_engine(cfg, run_dir=tmp_path)
    timeline = Timeline.from_chrome_trace(tmp_path / "timeline.json")
    assert_timeline_invariants(cfg, timeline)
    rollouts, trains = timeline.of("rollout"), timeline.of("train")
    assert rollouts and trains
    on_rollout = [e.args["ref_forwards"] for e in rollouts]
    on_trainer = [e.args["ref_forwards"] for e in trains]
    if where == "rollout":
        assert all(n > 0 for n in on_rollout) and not any(on_trainer)
    else:
        assert not any(on_rollout) and all(n > 0 for n in on_trainer)
    assert len(result.metrics) == 2
    assert all(math.isfinite(m["loss"]) for m in result.metrics) and result.metrics[1]["kl"] > 0


def test_the_planner_moves_the_reference_forward_to_the_rollout_unit():
    """FLUX.1-dev on 16 H800s (kl_beta > 0, LoRA, 9 trained steps of 10, G 16, micro-batch 4), a unit
    of one group, by hand: with rollout the train unit loses 9 positions x 4 micro-batches of a
    reference forward of 4 (TSP rank 0 of 2: 5 positions); the rollout unit gains 9 trained steps x 4
    sampling forwards of 4 at the rollout kernel (a sampling forward: ``rollout_step``), or 9 of 16 at a
    rollout batch of 16; a sample travels 9 latents of 64x64x16 fp32 more. auto: rollout on GPUs."""
    from dataclasses import replace
    from pathlib import Path

    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.gpus import load_cluster
    from digenrl.planner.workload import Workload

    root = Path(__file__).resolve().parents[1]
    cluster = load_cluster(root / "configs" / "clusters" / "16xH800.yaml")

    def cost(where: str) -> CostModel:
        cfg = load_config(root / "configs" / "flux1_dev.yaml", [f"algorithm.kl_reference={where}"])
        return CostModel(Workload.from_config(cfg), cluster)

    train, roll, auto = cost("train"), cost("rollout"), cost("auto")
    w = train.workload
    assert (w.kl, w.lora, w.trained_steps, w.group_size, w.micro_batch, w.optimizer_steps) == (
        True,
        True,
        9,
        16,
        4,
        1,
    )
    assert auto.workload.kl_reference == "rollout" and train.workload.kl_reference == "train"
    t = train.times("H800")
    assert t.ref_forward(4) > 0 and t.rollout_step(4) > 0
    saved = train.train_unit("H800", 1, 0, 1) - roll.train_unit("H800", 1, 0, 1)
    assert saved == pytest.approx(9 * 4 * t.ref_forward(4), rel=1e-9)
    saved_tsp = train.train_unit("H800", 1, 0, 2) - roll.train_unit("H800", 1, 0, 2)
    assert saved_tsp == pytest.approx(5 * 4 * t.ref_forward(4), rel=1e-9)
    added = roll.rollout_unit("H800", 1)[0] - train.rollout_unit("H800", 1)[0]
    assert added == pytest.approx(9 * 4 * t.rollout_step(4), rel=1e-9)
    from digenrl.planner.memory import DeviceSetup

    setup = DeviceSetup(fits=True, micro_batch=4, rollout_batch=16)
    added16 = roll.rollout_unit("H800", 1, setup)[0] - train.rollout_unit("H800", 1, setup)[0]
    assert added16 == pytest.approx(9 * roll.times("H800", setup).rollout_step(16), rel=1e-9)
    assert added16 < added < saved  # a larger batch at the rollout kernel costs less than the trainer's
    assert roll.workload.sample_bytes - train.workload.sample_bytes == 9 * 64 * 64 * 16 * 4
    on_cpu = CostModel(
        replace(auto.workload, kl_reference="auto"),
        load_cluster(root / "configs" / "clusters" / "local_cpu.yaml"),
    )
    assert on_cpu.workload.kl_reference == "train"  # auto on a CPU cluster: as the runtime resolves it


#: generated in shares or by a sequence-parallel pair: a rollout worker over 2 devices (rollout_sp), a
#: sharded trainer group whose ranks each generate their share of a unit (FSDP x2 + TAG)
SPLIT = {
    "rollout_sp": [
        "engine.rollout_sp=2",
        "engine.tag=false",
        "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
    ],
    "fsdp2_tag": [
        "train.fsdp=2",
        "engine.tag=true",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
    ],
    # DanceGRPO: each sample its own trained steps, so a rank's share may train none of a step its
    # group's other rank trains -- the reference passes run in lockstep (RolloutReference.lockstep)
    "fsdp2_tag_dance_grpo": [
        "algorithm.name=dance_grpo",
        "train.fsdp=2",
        "engine.tag=true",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", SPLIT)
def test_split_rollouts_with_the_reference_at_rollout_equal_the_local_trainer(case, ray_cluster, tmp_path):
    """The reference means computed by a sequence-parallel pair, or in a sharded group's shares and
    merged, train what the local trainer with its own reference forwards (kl_reference train) trains:
    the LoRA weights after 2 on-policy iterations to test_engine_sp's tolerance (1% of one Adam step:
    the samples and gradients agree to ~1e-6, summed in another order)."""
    from safetensors.torch import load_file

    from digenrl.engine.local import LocalTrainer
    from digenrl.engine.timeline import Timeline
    from digenrl.launch import run_engine
    from tests.helpers import QUIET

    base = [*KL, *QUIET, "train.iterations=2", "output.checkpoint_every=0", "engine.max_staleness=0"]
    base += ["engine.tsp_degree=1", "engine.gap=false"]
    name = [s for s in SPLIT[case] if s.startswith("algorithm.name")]
    local = [*base, *name, "algorithm.kl_reference=train"]
    ref = LocalTrainer(load_config(None, local)).run(tmp_path / "local")
    sets = [*base, "placement.mode=disaggregated", "algorithm.kl_reference=rollout", *SPLIT[case]]
    result = run_engine(load_config(None, sets), run_dir=tmp_path / "engine")
    lora = "final/pytorch_lora_weights.safetensors"
    want, got = load_file(tmp_path / "local" / lora), load_file(tmp_path / "engine" / lora)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    for mine, theirs in zip(result.metrics, ref.metrics, strict=True):
        assert mine["kl"] == pytest.approx(theirs["kl"], rel=1e-3, abs=1e-9)
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-3, abs=1e-6)
    assert ref.metrics[1]["kl"] > 0
    timeline = Timeline.from_chrome_trace(tmp_path / "engine" / "timeline.json")
    assert all(e.args["ref_forwards"] > 0 for e in timeline.of("rollout"))
    assert not any(e.args["ref_forwards"] for e in timeline.of("train"))
    if "engine.tag=true" in SPLIT[case]:  # the sharded group generated units in shares (TAG)
        assert any(e.worker.startswith("trainer") for e in timeline.of("rollout"))


def test_a_sharded_groups_shares_run_the_same_reference_forwards():
    """DanceGRPO: the two slices of one group train different steps; a sharded group's ranks must run
    the same forwards (FSDP2 gathers per forward). With the unit's steps as ``reference_steps`` both
    shares run one reference forward per step of them (whole_forwards: one forward per step), and
    the means they keep are those each share computes alone."""
    from digenrl.engine.fsdp_group import _reference_steps, unit_share

    cfg = load_config(None, [*KL, "algorithm.name=dance_grpo", "algorithm.kl_reference=rollout"])
    policy = perturbed_policy(cfg)
    prompts = PromptSampler(load_prompts(cfg.prompts), cfg.train.seed).for_iteration(0, 2)
    parts = [unit_share((0,), (0, 4), s, 2) for s in range(2)]
    steps = _reference_steps(cfg, 0, parts)
    alone, together = [], []
    for groups, span in parts:
        args = (policy, [prompts[g] for g in groups], list(groups), 0, cfg.train.seed, span)
        alone.append(rollout_unit(*args, whole_forwards=True)[0])
        together.append(rollout_unit(*args, whole_forwards=True, reference_steps=steps)[0])
    trained = [set(s.train_idx.unique().tolist()) for s in alone]
    assert trained[0] != trained[1] and set(steps) == trained[0] | trained[1]  # not vacuous
    assert [s.timings["ref_forwards"] for s in alone] == [len(t) for t in trained]
    assert [s.timings["ref_forwards"] for s in together] == [len(steps)] * 2
    for a, b in zip(alone, together):
        torch.testing.assert_close(b.ref_means, a.ref_means, atol=0, rtol=0)


def test_prefix_moves_the_kl_reference_back(monkeypatch):
    """The planner's shared-prefix search prices a prefix k > 0 with the reference on the trainer
    (kl_reference rollout refuses branched groups); k = 0 keeps the run's (auto: rollout on GPUs)."""
    from pathlib import Path

    from digenrl.planner import prefix_search
    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.gpus import load_cluster
    from digenrl.planner.workload import Workload

    root = Path(__file__).resolve().parents[1]
    w = Workload.from_config(load_config(root / "configs" / "flux1_dev.yaml", ["sampling.steps=8"]))
    cluster = load_cluster(root / "configs" / "clusters" / "4xH200.yaml")
    cost = CostModel(w, cluster)
    assert cost.workload.kl_reference == "rollout"
    priced = {}

    def search(cost, cluster, **kw):  # what each prefix is priced with
        priced[cost.workload.shared_prefix] = cost.workload.kl_reference

    monkeypatch.setattr(prefix_search, "search", search)
    prefix_search.search_shared_prefix(cost, cluster, prefixes=(0, 2))
    assert priced == {0: "rollout", 2: "train"}
