"""Can a tiny family's LoRA follow the prompt's colour at all, and how loudly does the prompt speak at init?

    python benchmarks/colour_capacity.py -c configs/flux2_tiny.yaml [--steps 60] [--lr 3e-3] [--json FILE]

Two numbers that separate a text path that cannot carry the prompt from an RL signal too weak to use it
(benchmarks/colour_margin.py measures the RL side): the prompt's share of the velocity at init,
|v(red) - v(blue)| / |v(red)| from the same noise at sigma 0.9 / 0.5 / 0.2; and supervised capacity, the
config's LoRA trained by Adam directly on the colour margin of the one-step clean-image prediction
``x - sigma v`` (sigma 0.7, the tiny preview decoder): each image's RGB distance to the other prompt's
colour minus to its own, mean colour, up to sqrt(2) (red / blue fully apart). No reward, no sampler.
Not a test: numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

TARGET = {"red": (1.0, 0.0, 0.0), "blue": (0.0, 0.0, 1.0)}


def sensitivity(ad, x, conds) -> list[float]:
    out = []
    for s in (0.9, 0.5, 0.2):
        sig = torch.full((len(x),), s)
        with torch.no_grad():
            vr, vb = (ad.velocity(x, sig, conds[c]) for c in ("red", "blue"))
        out.append(((vr - vb).norm() / vr.norm()).item())
    return out


def colour_margin(ad, x, conds, sigma: float = 0.7) -> torch.Tensor:
    """Mean over red / blue of |colour - other's target| - |colour - own target| (differentiable)."""
    sig = torch.full((len(x),), sigma)
    rgb = {}
    for c in TARGET:
        x0 = x - sigma * ad.velocity(x, sig, conds[c])
        img = ad.preview(ad.to_spatial(x0.float()))  # the tiny preset's decode (Adapter.decode, with grad)
        rgb[c] = img.mean(dim=tuple(range(2, img.ndim)))
    t = {c: torch.tensor(v) for c, v in TARGET.items()}
    gaps = [
        (rgb[c] - t[o]).norm(dim=-1) - (rgb[c] - t[c]).norm(dim=-1)
        for c, o in (("red", "blue"), ("blue", "red"))
    ]
    return torch.cat(gaps).mean()


def run(config: Path, steps: int, lr: float, sets: list[str]) -> dict:
    from digenrl.adapters import build_adapter
    from digenrl.config.run import load_config
    from digenrl.policy.lora import apply_lora

    cfg = load_config(config, sets)
    ad = build_adapter(cfg.model, cfg.sampling)
    if ad.preview is None:
        raise SystemExit("colour_capacity: a tiny preset (its preview decoder) is needed")
    x = ad.initial_noise(8, torch.Generator().manual_seed(0))
    conds = {c: ad.encode_prompts([f"a {c} apple"] * len(x)) for c in TARGET}
    share = sensitivity(ad, x, conds)
    apply_lora(ad.transformer, cfg.model.lora, ad.default_lora_targets)
    params = [p for p in ad.transformer.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    margins = []
    for step in range(steps + 1):
        m = colour_margin(ad, x, conds)
        margins.append(m.item())
        if step < steps:
            opt.zero_grad()
            (-m).backward()
            opt.step()
    return {"config": str(config), "prompt_share": share, "lr": lr, "margins": margins}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    r = run(args.config, args.steps, args.lr, args.set)
    share = " / ".join(f"{s:.3f}" for s in r["prompt_share"])
    at = {k: r["margins"][k] for k in range(0, len(r["margins"]), 20)}
    print(f"{args.config}: prompt's share of v at sigma 0.9 / 0.5 / 0.2: {share}")
    print("supervised margin by Adam step: " + ", ".join(f"{k}: {m:+.3f}" for k, m in at.items()))
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
