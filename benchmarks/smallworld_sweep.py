"""Does RL learn on the small world? One process (``placement.mode: local``), settings side by side.

    python benchmarks/smallworld_sweep.py --iterations 150 --seeds 0,1 [--threads 1] [--eval-seeds 2]
        [--set K=V ...] --variant lr3e-4:train.lr=3e-4 --variant full:model.lora=null,train.lr=1e-4 ...
        [--json F]

Each variant (a name and comma-separated overrides of configs/smallworld_flux.yaml) trains for
``--iterations`` (or its own ``train.iterations``) per seed, the variants of a seed in turn (load
drift hits them alike). Per run: the training reward's gain (last third's mean minus the first
third's), per 1k samples and per wall-minute; the mean over categories of each one's gain (the
iterations' prompts are drawn at random: the category mix moves the plain mean by as much); the
share of groups whose samples all scored alike (zero advantage: no signal), the training reward
per category in the first and last third, and the held-out score after it
(``--eval-seeds`` ODE samples of each test caption, the partial score, per category;
the base model's once, first; ``--set prompts.file=configs/smallworld``: the whole world's
captions, to train on and held out). The load average is recorded beside every run. Not a test.

Diagnostics: ``--probe N``: no training, N iterations of rollouts at each variant's settings (the
reward of the training samples, per category, the spread within groups, the mean |advantage|);
``reward.components.0.name=brightness,reward.components.0.args={}`` in a variant trains on the
mean pixel value instead (:class:`Brightness`, registered here only: a reward any policy can raise,
to tell a defect of the pretrained + LoRA path from a hard reward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from digenrl.rewards.base import Reward, register

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smallworld_flux.yaml"
RUN_SET = ["output.checkpoint_every=0", "output.save_samples_every=0", "output.tensorboard=false"]


@register("brightness")
class Brightness(Reward):
    """The mean pixel value (the caption ignored): bigger or more objects score higher."""

    def score(self, images, prompts, metadata):
        return images.float().mean(dim=(1, 2, 3))


def third(values: list[float], last: bool) -> float:
    k = max(1, len(values) // 3)
    return statistics.fmean(values[-k:] if last else values[:k])


def held_out(policy, reward, prompts, seeds: int) -> dict:
    """Mean partial score over ``seeds`` ODE samples of each held-out caption, overall (the mean of
    the categories') and per category."""
    from digenrl.run.evaluate import evaluate_policy

    by_tag = defaultdict(list)
    for s in range(seeds):
        r = evaluate_policy(policy, reward, prompts, seed=1000 + s)
        for tag, v in zip(r.tags, r.total.tolist()):
            by_tag[tag].append(v)
    tags = {t: statistics.fmean(v) for t, v in sorted(by_tag.items())}
    return {"overall": statistics.fmean(tags.values()), "by_tag": tags}


def run(overrides: list[str], iterations: int, eval_seeds: int, test) -> dict:
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer

    sets = ["placement.mode=local", *RUN_SET, f"train.iterations={iterations}", *overrides]
    cfg = load_config(CONFIG, sets)
    iterations = cfg.train.iterations  # a variant may set its own
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    trainer = LocalTrainer(cfg)
    tag_of = {p.text: p.meta.get("tag") for p in trainer.prompts.prompts}
    rows, per_tag = [], []
    t_first = None
    for it in range(iterations):
        rows.append(trainer.iteration(it))
        t_first = t_first or time.perf_counter()  # wall time from the first iteration's end, as learning.py
        tags = defaultdict(list)
        for u in trainer.last_units:
            for p, r in zip(u.prompts, u.rewards.tolist()):
                tags[tag_of[p]].append(r)
        per_tag.append({t: statistics.fmean(v) for t, v in tags.items()})
    wall = time.perf_counter() - t_first
    rewards = [r["reward_mean"] for r in rows]
    n = rows[0]["samples"]
    gain = third(rewards, True) - third(rewards, False)
    cats = sorted({t for d in per_tag for t in d})
    col = lambda t, last: third([d[t] for d in per_tag if t in d], last)  # noqa: E731
    out = {
        "overrides": overrides,
        "iterations": iterations,
        "samples": n * iterations,
        "wall_s": wall,
        "gain": gain,
        "gain_per_1k": gain / (n * iterations / 1000),
        "gain_per_min": gain / (wall / 60),
        "zero_adv_groups": 1
        - statistics.fmean(v for r in rows for k, v in r.items() if k.startswith("adv_groups/")),
        "train_by_tag": {t: (col(t, False), col(t, True)) for t in cats},
        "gain_by_tag_mean": statistics.fmean(col(t, True) - col(t, False) for t in cats),
        "rewards": rewards,
        "load_before": load0,
    }
    if eval_seeds:
        out["held_out"] = held_out(trainer.policy, trainer.reward, test, eval_seeds)
    out["load_after"] = os.getloadavg()[0]
    out["total_s"] = time.perf_counter() - t0
    return out


def probe(overrides: list[str], iterations: int) -> dict:
    """The training rollouts of ``iterations`` iterations at the variant's settings, untrained."""
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer
    from digenrl.units.advantages import assign_advantages

    cfg = load_config(CONFIG, ["placement.mode=local", *RUN_SET, *overrides])
    trainer, G = LocalTrainer(cfg), cfg.algorithm.group_size
    tag_of = {p.text: p.meta.get("tag") for p in trainer.prompts.prompts}
    rewards, tags, spread, adv = [], defaultdict(list), [], []
    for it in range(iterations):
        units = trainer.rollout(it)
        assign_advantages(units, cfg)
        for u in units:
            spread += u.rewards.view(-1, G).std(dim=1, correction=0).tolist()
            adv += u.advantages.abs().tolist()
            rewards += u.rewards.tolist()
            for p, r in zip(u.prompts, u.rewards.tolist()):
                tags[tag_of[p]].append(r)
    return {
        "overrides": overrides,
        "samples": len(rewards),
        "reward": statistics.fmean(rewards),
        "by_tag": {t: statistics.fmean(v) for t, v in sorted(tags.items())},
        "group_std": statistics.fmean(spread),
        "abs_advantage": statistics.fmean(adv),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME:KEY=V[,KEY=V...]")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--iterations", type=int, default=150)
    ap.add_argument("--eval-seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--set", action="append", default=[], help="KEY=V for every run and the held-out eval")
    ap.add_argument("--probe", type=int, default=0, help="N: untrained rollouts of N iterations instead")
    args = ap.parse_args(argv)
    import torch

    from digenrl.config.run import load_config
    from digenrl.data.prompts import load_prompts
    from digenrl.policy.model import Policy
    from digenrl.rewards import build_reward

    torch.set_num_threads(args.threads)
    variants = [(v.split(":", 1)[0], [s for s in v.split(":", 1)[1].split(",") if s]) for v in args.variant]
    cfg = load_config(CONFIG, ["placement.mode=local", *args.set])
    test = load_prompts(cfg.prompts, split="test")
    result = {"threads": args.threads, "cpu_count": os.cpu_count(), "runs": []}
    if args.probe:
        for name, sets in variants:
            r = {"name": name, **probe([*args.set, *sets], args.probe)}
            result["runs"].append(r)
            by_tag = " ".join(f"{t}={v:.2f}" for t, v in r["by_tag"].items())
            print(
                f"{name}: reward {r['reward']:.3f} ({r['samples']} samples; {by_tag}), within-group std "
                f"{r['group_std']:.3f}, mean |A| {r['abs_advantage']:.2f}",
                flush=True,
            )
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return 0
    if args.eval_seeds:
        base = Policy(cfg, trainable=False)
        result["base"] = held_out(base, build_reward(cfg.reward), test, args.eval_seeds)
        print(f"base held-out {result['base']['overall']:.3f} {result['base']['by_tag']}", flush=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, sets in variants:
            r = run([*args.set, *sets, f"train.seed={seed}"], args.iterations, args.eval_seeds, test)
            r.update(name=name, seed=seed)
            result["runs"].append(r)
            ho = f", held-out {r['held_out']['overall']:.3f}" if "held_out" in r else ""
            tags = {t: f"{a:.2f}->{b:.2f}" for t, (a, b) in r["train_by_tag"].items()}
            print(
                f"{name} seed {seed}: gain {r['gain']:+.3f} (by tag {r['gain_by_tag_mean']:+.3f}; "
                f"{r['gain_per_1k']:+.4f}/1k, "
                f"{r['gain_per_min']:+.3f}/min, {r['wall_s']:.0f} s) zero-adv {r['zero_adv_groups']:.2f}{ho} "
                f"load {r['load_before']:.1f}-{r['load_after']:.1f} by tag {tags}",
                flush=True,
            )
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
