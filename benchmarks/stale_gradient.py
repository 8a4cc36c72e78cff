"""Why one-step async learned less: the stale samples' log-prob gradient, isolated in one process.

    python benchmarks/stale_gradient.py [--iterations 60] [--seeds 0,1,2]
                                        [--variants on_policy,stale_raw,stale_recentred] [--json FILE]

No Ray, no engine: the local trainer, with one-step staleness simulated exactly -- iteration k's
samples are generated with version k-1's weights and trained with version k's (the engine's
``max_staleness: 1`` without its scheduling, TAG units or timing). Variants:

- ``on_policy``: the plain local trainer (staleness 0);
- ``stale_raw``: stale samples, the log-prob gradient of the recorded sample as is
  (``algorithm.stale_gradient: raw``, the objective before the fix);
- ``stale_recentred``: stale samples, the recorded step noise put around the current step mean
  (``algorithm.stale_gradient: recentred``).

Per variant and seed: the reward gain (mean ``reward_mean`` of the last third minus the first third),
the mean grad norm, and, every ``--probe_every`` iterations of the stale variants, the per-timestep
decomposition of the stale gradient into its score part (noise / scale^2 * dmu, what an on-policy
sample contributes) and its drift part ((mu_behaviour - mu) / scale^2 * dmu, only a stale sample
has it): the norm of each and their ratio. Not a test: numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

VARIANTS = {
    "on_policy": [],
    "stale_raw": ["algorithm.stale_gradient=raw"],
    "stale_recentred": ["algorithm.stale_gradient=recentred"],
}


def gain(rewards: list[float]) -> float:
    """Mean of the last third minus mean of the first third."""
    k = max(1, len(rewards) // 3)
    return statistics.fmean(rewards[-k:]) - statistics.fmean(rewards[:k])


def stale_trainer(cfg):
    """A LocalTrainer whose iteration k rolls out with version k-1's weights (one-step async)."""
    from digenrl.engine.local import LocalTrainer

    class StaleTrainer(LocalTrainer):
        previous = None  # version k-1's weights

        def rollout(self, iteration):
            current = self.policy.weights()
            version = self.policy.version
            if self.previous is not None:
                self.policy.load_weights(self.previous, version - 1)
                self.policy.version = version - 1
            units = super().rollout(iteration)
            self.policy.load_weights(current, version)
            self.policy.version = version
            self.previous = current
            return units

    return StaleTrainer(cfg)


def probe(policy, units) -> list[dict]:
    """Per trained step i: |score part|, |drift part| of the stale gradient of sum(A * logp) / terms."""
    from digenrl.algorithms.sde import logprob_of_velocity
    from digenrl.units.train import recentred_logprob

    cfg, ad = policy.cfg, policy.adapter
    kind, eta = cfg.sampling.sde, cfg.sampling.noise_level
    out = {}
    for u in units:
        sig = u.sigmas
        for i in u.train_idx[0].tolist():
            x, x_next, noise = u.latents[:, i], u.latents[:, i + 1], u.step_noise[:, i]
            v = ad.velocity(x, sig[i].expand(len(u)), u.cond)
            raw, mu, std = logprob_of_velocity(v, x, x_next, sig, i, kind, eta)
            score = recentred_logprob(kind, mu, noise, sig, i, std)
            a = u.advantages
            g_raw = torch.autograd.grad((a * raw).mean(), policy.params, retain_graph=True)
            g_score = torch.autograd.grad((a * score).mean(), policy.params)
            flat = lambda g: torch.cat([t.reshape(-1) for t in g])  # noqa: E731
            r, s = flat(g_raw), flat(g_score)
            rec = out.setdefault(i, {"score": [], "drift": [], "drift_over_scale": []})
            rec["score"].append(s.norm().item())
            rec["drift"].append((r - s).norm().item())
            drift = (x_next - noise - mu.detach()).reshape(len(u), -1)  # mu_behaviour - mu
            scale = noise.reshape(len(u), -1).std().item()
            rec["drift_over_scale"].append(drift.pow(2).mean().sqrt().item() / scale)
    return [{"step": i, **{k: statistics.fmean(v) for k, v in rec.items()}} for i, rec in sorted(out.items())]


def run(variant: str, seed: int, iterations: int, probe_every: int, extra: list[str]) -> dict:
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer
    from digenrl.units.advantages import assign_advantages

    cfg = load_config(
        None,
        [
            "placement.mode=local",
            f"train.iterations={iterations}",
            f"train.seed={seed}",
            *VARIANTS[variant],
            *extra,
        ],
    )
    trainer = LocalTrainer(cfg) if variant == "on_policy" else stale_trainer(cfg)
    rewards, norms, probes = [], [], []
    for it in range(iterations):
        row = trainer.iteration(it)
        rewards.append(row["reward_mean"])
        norms.append(row["grad_norm"])
        if variant != "on_policy" and probe_every and it % probe_every == probe_every - 1:
            previous = trainer.previous
            units = trainer.rollout(it + 1)  # next iteration's stale samples, not trained on
            trainer.previous = previous  # (the probe's rollout moved it one version on)
            assign_advantages(units, cfg)
            probes.append({"iteration": it + 1, "steps": probe(trainer.policy, units)})
    return {
        "variant": variant,
        "seed": seed,
        "gain": gain(rewards),
        "grad_norm_mean": statistics.fmean(norms),
        "rewards": rewards,
        "probes": probes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--probe_every", type=int, default=20, help="0: no gradient decomposition")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        print(f"error: --variants: unknown {', '.join(unknown)} ({', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:  # interleaved: load drift hits every variant
        for variant in variants:
            r = run(variant, seed, args.iterations, args.probe_every, args.set)
            runs.append(r)
            print(
                f"{variant:16s} seed {seed}: gain {r['gain']:+.3f}  grad_norm {r['grad_norm_mean']:.4f}",
                flush=True,
            )
            for p in r["probes"]:
                steps = "  ".join(
                    f"t{s['step']}: score {s['score']:.4f} drift {s['drift']:.4f} "
                    f"(|dmu|/scale {s['drift_over_scale']:.2f})"
                    for s in p["steps"]
                )
                print(f"    probe @{p['iteration']}: {steps}", flush=True)
    for variant in variants:
        gains = [r["gain"] for r in runs if r["variant"] == variant]
        se = statistics.stdev(gains) / len(gains) ** 0.5 if len(gains) > 1 else float("nan")
        print(f"{variant:16s} gain {statistics.fmean(gains):+.3f} +- {se:.3f} (SE, {len(gains)} seeds)")
    if args.json:
        args.json.write_text(json.dumps({"iterations": args.iterations, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
