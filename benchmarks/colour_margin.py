"""Does a tiny family learn the colour demo from its prompt, or a colour every prompt scores on?

    python benchmarks/colour_margin.py -c configs/flux2_tiny.yaml [--seeds 0,1] [--iterations 24]
                                       [--set k=v ...] [--json FILE]

The loop of tests/test_families.py::test_family_learns (``LocalTrainer``, red / blue x apple / car,
``train.iterations``), and its criterion: the gain of the last third's mean reward over the first
third's, against its noise sqrt(var/8 + var/8). The reward (1 - the RGB distance to the prompt's colour)
also rises for an image that moves towards a colour between red and blue whatever the prompt, so
before and after training the script draws a red and a blue prompt from the same noise (ODE,
``sampling.eval_steps``) and reports the margin: each image's reward under its own colour minus under
the other colour (0 when the prompt does not change the image), and the pixels' mean |red - blue|.
Not a test: numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = "a red apple\na red car\na blue apple\na blue car\n"


@torch.no_grad()
def margin(policy, n: int = 8) -> dict:
    """Paired ODE samples of red / blue x apple / car from ``n`` shared noises."""
    from digenrl.algorithms.sde import sample
    from digenrl.rewards.basic import PromptColor

    ad, reward = policy.adapter, PromptColor()
    noise = ad.initial_noise(n, torch.Generator().manual_seed(1000)).to(ad.device)
    sigmas = ad.sigmas(policy.cfg.sampling.eval_steps)
    gaps, own, diff = [], [], []
    for obj in ("apple", "car"):
        img = {}
        for c in ("red", "blue"):
            lat = sample(ad, ad.encode_prompts([f"a {c} {obj}"] * n), noise, sigmas, "flow_grpo", 0.0, None)
            img[c] = ad.decode(lat.latents[:, -1]).cpu()
        for c, other in (("red", "blue"), ("blue", "red")):
            mine = reward.score(img[c], [c] * n, [{}] * n)
            gaps.append(mine - reward.score(img[c], [other] * n, [{}] * n))
            own.append(mine)
        diff.append((img["red"] - img["blue"]).abs().mean())
    return {
        "margin": torch.cat(gaps).mean().item(),
        "own_reward": torch.cat(own).mean().item(),
        "pixel_diff": torch.stack(diff).mean().item(),
    }


def run(config: Path, seed: int, iterations: int, sets: list[str]) -> dict:
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer

    tmp = Path(tempfile.mkdtemp())
    (tmp / "p.txt").write_text(PROMPTS)
    cfg = load_config(
        config,
        [f"train.iterations={iterations}", f"prompts.file={tmp / 'p.txt'}", f"output.run_dir={tmp / 'run'}"]
        + [f"train.seed={seed}", "output.save_samples_every=0", *sets],
    )
    trainer = LocalTrainer(cfg)
    before = margin(trainer.policy)
    rewards = [r["reward_mean"] for r in trainer.run().metrics]
    k = max(1, len(rewards) // 3)
    first, last = rewards[:k], rewards[-k:]
    var = sum(statistics.variance(x) / k for x in (first, last)) if k > 1 else 0.0
    return {
        "config": str(config),
        "seed": seed,
        "gain": statistics.mean(last) - statistics.mean(first),
        "noise": var**0.5,
        "before": before,
        "after": margin(trainer.policy),
        "rewards": rewards,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        r = run(args.config, seed, args.iterations, args.set)
        runs.append(r)
        b, a = r["before"], r["after"]
        print(
            f"seed {seed}: gain {r['gain']:+.3f} (noise {r['noise']:.3f}); margin {b['margin']:+.4f} -> "
            f"{a['margin']:+.4f}, |red - blue| pixels {b['pixel_diff']:.4f} -> {a['pixel_diff']:.4f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
