"""The small world's detector against the truth, per GenEval category, on held-out drawings (the
held-out captions, seeds no pretraining run draws):

    .venv/bin/python benchmarks/smallworld_detector.py [--n 500] [--vae models/smallworld_flux]

For each category, ``n`` drawings of its held-out captions, each judged twice by the ``smallworld``
reward (GenEval's rules on the detector's objects) against the verdict of the same rules on the
objects actually drawn: with its own caption (the truth: correct) and with another caption of the
category drawn at random (the truth: mostly wrong). ``objects`` is the share whose detections equal
the drawn objects exactly (class, colour, box). ``--vae DIR`` repeats it on the drawings passed
through that checkpoint's VAE (encode, decode): blurred as a generator's samples are.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

from digenrl.rewards.geneval import Rules
from digenrl.rewards.smallworld.detect import detect
from digenrl.rewards.smallworld.world import TAGS, sample_scene, split_rows

SEED0 = 1_000_000  # drawing seeds from here: none of benchmarks/smallworld_pretrain.py's


def truth(objs: list[dict]) -> dict:
    found: dict[str, list[dict]] = {}
    for o in objs:
        found.setdefault(o["class"], []).append({"box": o["box"], "score": 1.0, "color": o["color"]})
    return found


def measure(n: int, vae=None) -> dict:
    rules, rng = Rules(), random.Random(0)
    rows = split_rows()[1]
    out = {}
    for tag in TAGS:
        mine = [r for r in rows if r["tag"] == tag]
        scenes = [(mine[i % len(mine)], *sample_scene(mine[i % len(mine)], SEED0 + i)) for i in range(n)]
        images = np.stack([img for _, img, _ in scenes])
        if vae is not None:
            with torch.no_grad():
                x = torch.from_numpy(images).permute(0, 3, 1, 2) * 2 - 1
                rec = vae.decode(vae.encode(x).latent_dist.mode()).sample
                images = (rec / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
        own = other = exact = 0
        wrong_truths = 0
        for (meta, _, objs), img in zip(scenes, images):
            det = detect(img)
            own += rules.judge(det, meta)[0] == rules.judge(truth(objs), meta)[0]
            alt = rng.choice([r for r in mine if r is not meta] or mine)
            t = rules.judge(truth(objs), alt)[0]
            wrong_truths += t == 0
            other += rules.judge(det, alt)[0] == t
            exact += sorted((c, o["color"], tuple(o["box"])) for c, v in det.items() for o in v) == sorted(
                (o["class"], o["color"], tuple(o["box"])) for o in objs
            )
        out[tag] = {
            "own_caption": own / n,
            "other_caption": other / n,
            "other_caption_truly_wrong": wrong_truths / n,
            "objects": exact / n,
        }
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500, help="drawings per category")
    ap.add_argument("--vae", type=Path, help="a checkpoint directory: also on its VAE's reconstructions")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    result = {"drawn": measure(args.n)}
    if args.vae is not None:
        from diffusers import AutoencoderKL

        result["vae"] = measure(args.n, AutoencoderKL.from_pretrained(args.vae, subfolder="vae").eval())
    for kind, table in result.items():
        print(f"{kind}: category | own caption | other caption (truly wrong) | objects exact")
        for tag, r in table.items():
            print(
                f"  {tag:14s} {r['own_caption']:.3f}  {r['other_caption']:.3f} "
                f"({r['other_caption_truly_wrong']:.2f})  {r['objects']:.3f}"
            )
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
