"""Every rank of a sharded group runs the same sequence of collectives (issue 53, item 1): Wan2.2
A14B's two experts are each an FSDP2 root, and DiffusionNFT / AWM / online DPO give each row its own
noise level, so one rank's rows may need both experts while another's need one. Two gloo ranks
train their shares of one unit (``fsdp_group.train_share``, the engine's path) with rows chosen so:
rank 0's first pass mixes a high- and a low-noise row, rank 1's is all low noise (and, with
``train_experts: low_noise``, rank 1's other pass is all on the frozen expert). Each rank records,
in order, the experts it runs and the collectives it issues; the two records are equal. On 8f4fead
rank 0 ran both experts and rank 1 only ``transformer_2`` (under NCCL a hang; under gloo the
same-shaped experts' gathers paired up and mixed shards), and a rank whose rows hit only the frozen
expert skipped its backward while its peer reduce-scattered."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.dist_spawn import spawn

pytestmark = pytest.mark.slow

CASES = {  # name -> config overrides
    "nft_both": ["algorithm.name=diffusion_nft"],
    "nft_low_noise": ["algorithm.name=diffusion_nft", "model.train_experts=low_noise"],
    "awm": ["algorithm.name=awm"],
}
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor")
COLLECTIVES += ("reduce_scatter_tensor", "broadcast", "barrier")
#: per rank, its rows' trained steps (wan2.2_tiny, 8 steps at shift 3: steps 0-2 are the high-noise
#: expert's): rank 0's first pass mixes both experts, rank 1's first is all low, its second all high
STEPS = {0: [[0, 5], [5, 0]], 1: [[5, 1], [6, 2]]}


def _record(net, log: list):
    """Log each expert's forwards and every collective torch.distributed issues, in order."""
    import torch.distributed as dist

    for name, expert in zip(("transformer", "transformer_2"), net.experts()):
        expert.register_forward_pre_hook(lambda *_, name=name: log.append(("forward", name)))
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def call(*args, real=real, name=name, **kwargs):
            sizes = [a.numel() for a in args if isinstance(a, torch.Tensor)]
            log.append((name, tuple(sizes)))
            return real(*args, **kwargs)

        setattr(dist, name, call)


def _train(rank, world, out):
    import dataclasses

    from digenrl.config.run import load_config
    from digenrl.data.prompts import PromptSampler, load_prompts
    from digenrl.distributed import fsdp
    from digenrl.engine.fsdp_group import train_share
    from digenrl.policy.model import Policy
    from digenrl.rewards import build_reward
    from digenrl.units.advantages import assign_advantages
    from digenrl.units.rollout import rollout_unit, scored

    logs = {}
    for case, sets in CASES.items():
        overrides = [*sets, "algorithm.group_size=2", "sampling.guidance=1.0", "train.micro_batch=8"]
        cfg = load_config("configs/wan2.2_tiny.yaml", [*overrides, "model.lora=null", "model.frames=1"])
        torch.manual_seed(0)
        policy = Policy(cfg, device="cpu")
        prompts = PromptSampler(load_prompts(cfg.prompts), 0).for_iteration(0, 2)
        unit = scored(rollout_unit(policy, prompts, [0, 1], 0, 0), build_reward(cfg.reward))
        assign_advantages([unit], cfg)
        steps = torch.tensor(STEPS[0] + STEPS[1])  # rows 0-1 are rank 0's share, 2-3 rank 1's
        unit = dataclasses.replace(unit, train_idx=steps)
        fsdp.shard_policy(policy, fsdp.trainer_mesh())
        log = logs[case] = []
        _record(policy.adapter.transformer, log)
        train_share(policy, unit, SimpleNamespace(step=0, tsp_rank=0, tsp_degree=1), rank, world, 8)
    torch.save(logs, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_collectives")
    spawn(_train, 2, out)
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_runs_the_same_experts_and_collectives(logs, case):
    a, b = logs[0][case], logs[1][case]
    assert a == b, next((i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y) if a != b else None
    forwards = [name for kind, name in a if kind == "forward"]
    assert forwards.count("transformer") == forwards.count("transformer_2") > 0  # high first, each pass
    assert forwards[:2] == ["transformer", "transformer_2"]
    assert any(kind == "reduce_scatter_single" for kind, _ in a)  # the trained expert's gradients
