"""What a TAG trainer rank holds while it rolls out (issue 52; the authors' RFC, verl-omni#321: the helper
runs between train units, beside the rank's training state), at a published shape, on ``meta``.

Rank 0 of an 8-way FSDP2 group is built by ``meta_memory_audit.sharded_rank`` (the runtime's ``Policy``
and ``shard_trainer_rank``; one gradient and one AdamW step: accumulated gradients and the optimizer
state exist). While it samples a rollout unit it also holds:

- the gathered blocks: FSDP2 unshards a block for its forward and prefetches the next (the two
  largest blocks, whole, in the compute dtype), and the root's own parameters (embedders, final
  layers) for the whole forward -- counted from the sharded module's DTensors (their global shapes);
- the trajectory: ``algorithms.sde.sample`` itself run on ``meta`` for the unit's samples at the
  family's latent size (a velocity of the right shape stands in for the transformer), its buffers
  counted.

Each part is compared with ``planner/memory.py`` (``train_parts``' shards, ``compute copy`` and
``trajectory_bytes``). Not audited here: the text encoders / VAE (``rollout models``, published
parameter counts) and a sampling forward's activations (live only inside it).

    python benchmarks/meta_memory_audit.py --tag [--only NAME] [--json F]
"""

from __future__ import annotations

import torch

GiB = 2**30
# (row name, config, overrides, groups per TAG unit)
TAG_CASES = [("flux1_dev LoRA, TAG unit of 4 groups", "flux1_dev.yaml", [], 4)]


def gathered_bytes(net, dtype: torch.dtype) -> tuple[int, int]:
    """(the two largest blocks whole, the root's own parameters whole), in ``dtype`` bytes, from the
    sharded module (a DTensor's global shape is what its all-gather returns)."""
    from digenrl.distributed.blocks import transformer_blocks

    size = torch.tensor([], dtype=dtype).element_size()
    blocks = transformer_blocks(net)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    whole = sorted((sum(p.numel() * size for p in b.parameters()) for b in blocks), reverse=True)
    root = sum(p.numel() * size for p in net.parameters() if id(p) not in in_blocks)
    return sum(whole[:2]), root


def trajectory_bytes(samples: int, latent_elements: int, steps: int) -> int:
    """The buffers ``algorithms.sde.sample`` allocates for ``samples`` samples of ``steps`` steps, run on
    ``meta`` (the velocity: zeros of the latent's shape)."""
    from types import SimpleNamespace

    from digenrl.algorithms.sde import sample

    adapter = SimpleNamespace(velocity=lambda x, sigma, cond: torch.zeros_like(x), sigma_input=lambda s: s)
    noise = torch.empty((samples, latent_elements), device="meta")
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    randn = lambda shape: torch.empty(shape, device="meta")  # noqa: E731
    out = sample(adapter, None, noise, sigmas, "flow_grpo", 0.7, randn=randn)
    return sum(t.numel() * t.element_size() for t in (out.latents, out.noise, out.log_probs))


def tag_audit(name: str, config: str, sets: list[str], groups: int) -> dict:
    from meta_memory_audit import ROOT, WORLD, audit, sharded_rank

    from digenrl.config.run import load_config
    from digenrl.planner.memory import MemoryModel
    from digenrl.planner.params import CostParams
    from digenrl.planner.workload import Workload

    cfg = load_config(ROOT / "configs" / config, sets)
    rank = sharded_rank(cfg)
    row = audit(name, config, sets, rank)  # the shards, fp32 masters, gradients, AdamW state
    w = Workload.from_config(cfg)
    model = MemoryModel(w, CostParams())
    blocks, root = gathered_bytes(rank[1], getattr(torch, cfg.model.dtype))
    samples = groups * cfg.algorithm.group_size
    held = {
        **{k: v for k, v in row["held"].items() if v},
        "gathered blocks": blocks,
        "gathered root": root,
        "trajectory": trajectory_bytes(samples, w.shape.tokens.latent_elements, w.steps),
    }
    planned = {k: v for k, v in row["planner_parts"].items() if v}
    planned = {**planned, "trajectory": model.trajectory_bytes(samples)}
    planned["compute copy"] = model.gathered_block()  # a sharded rank's, whatever train_parts' shard
    total, plan = sum(held.values()), sum(planned.values())
    return {
        "name": name,
        "config": f"configs/{config}",
        "world": WORLD,
        "samples": samples,
        "held": held,
        "planner_parts": planned,
        "total": total,
        "planner": plan,
        "difference": (total - plan) / plan,
        "full_size_count": row["full_size_count"],
        "rollout_models_planner": model.rollout_models(),
    }


def tag_markdown(rows: list[dict]) -> str:
    lines = ["| case | part | rank 0 holds (GiB) | planner (GiB) |", "|---|---|---|---|"]
    for r in rows:
        planned = dict(r["planner_parts"])
        gathered = r["held"].get("gathered blocks", 0) + r["held"].get("gathered root", 0)
        for part, b in r["held"].items():
            if part == "gathered root":
                continue
            mine = gathered if part == "gathered blocks" else b
            theirs = planned.pop("compute copy" if part == "gathered blocks" else part, 0.0)
            lines.append(f"| {r['name']} | {part} | {mine / GiB:.3f} | {theirs / GiB:.3f} |")
        lines.append(
            f"| {r['name']} | **total** | {r['total'] / GiB:.3f} | {r['planner'] / GiB:.3f} "
            f"({r['difference']:+.1%}) |"
        )
    return "\n".join(lines)
