"""Issue 53's checks on the device's own kernels (benchmarks/gpu_smoke.sh, part ``gpu_ready``):

- timesteps: every family's adapter at bf16 passes its transformer the timestep and guidance its
  diffusers pipeline passes, dtype and bits, over a 28-step schedule (tests/test_pipeline_timesteps.py
  on the CPU; bf16 rounding on the GPU is what a run gets);
- collectives: Wan2.2 A14B under FSDP2 with per-row noise levels (DiffusionNFT): the two shares of a
  unit that need different experts (tests/test_expert_collectives.py's rows) run the same experts, in
  the same order, and the same collectives, each share trained in turn on one FSDP2 rank (NCCL on a
  GPU; a world of one issues no collective, so the experts are what is compared: one device is enough;
  the two-rank version is the CPU test's).

    python benchmarks/gpu_ready.py --json OUT.json                                   (cuda)
    python benchmarks/gpu_ready.py --device cpu --families flux wan22 --json OUT.json  (a dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checks are the tests' own (tests/), run on this device


def timesteps(device: str, families: list[str]) -> dict:
    from tests.test_pipeline_timesteps import difference, timestep_calls

    out = {}
    for family in families:
        with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
            try:
                ours, theirs = timestep_calls(family, Path(tmp), mp, device)
                out[family] = difference(family, ours, theirs) or "ok"
            except Exception as e:  # reported, the other families still checked
                out[family] = f"error: {type(e).__name__}: {e}"[:300]
    return out


def collectives(device: str) -> dict:
    """Per share, the experts and collectives its training ran (one rank: the group's decisions)."""
    import dataclasses

    from digenrl.config.run import load_config
    from digenrl.data.prompts import PromptSampler, load_prompts
    from digenrl.distributed import fsdp
    from digenrl.engine.fsdp_group import train_share
    from digenrl.policy.model import Policy
    from digenrl.rewards import build_reward
    from digenrl.units.advantages import assign_advantages
    from digenrl.units.rollout import rollout_unit, scored
    from tests.test_expert_collectives import STEPS, _record

    sets = ["algorithm.name=diffusion_nft", "algorithm.group_size=2", "sampling.guidance=1.0"]
    sets += ["train.micro_batch=8", "model.lora=null", "model.frames=1", f"train.device={device}"]
    cfg = load_config(ROOT / "configs" / "wan2.2_tiny.yaml", sets)
    torch.manual_seed(0)
    policy = Policy(cfg, device=device)
    prompts = PromptSampler(load_prompts(cfg.prompts), 0).for_iteration(0, 2)
    unit = scored(rollout_unit(policy, prompts, [0, 1], 0, 0), build_reward(cfg.reward))
    assign_advantages([unit], cfg)
    unit = dataclasses.replace(unit, train_idx=torch.tensor(STEPS[0] + STEPS[1]))
    fsdp.shard_policy(policy, fsdp.trainer_mesh())
    log: list = []
    _record(policy.adapter.transformer, log)
    shares = []
    for rank in (0, 1):
        del log[:]
        train_share(policy, unit, SimpleNamespace(step=0, tsp_rank=0, tsp_degree=1), rank, 2, 8)
        shares.append([list(map(str, entry)) for entry in log])
    return {"equal": shares[0] == shares[1], "share0": shares[0], "share1": shares[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", nargs="*", help="default: every family of the CPU test")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from tests.test_pipeline_timesteps import FAMILIES

    if args.device == "cuda":
        torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        report = {"device": args.device, "timesteps": timesteps(args.device, args.families or list(FAMILIES))}
        report["collectives"] = collectives(args.device)
    finally:
        dist.destroy_process_group()
    report["ok"] = report["collectives"]["equal"] and set(report["timesteps"].values()) == {"ok"}
    for family, verdict in report["timesteps"].items():
        print(f"timesteps {family}: {verdict}")
    print(f"collectives: {'the same on both shares' if report['collectives']['equal'] else 'DIFFER'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
