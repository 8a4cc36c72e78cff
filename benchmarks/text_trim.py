"""Qwen-Image's text trimmed to the prompts' length vs padded to ``model.max_text_len`` (issue 51).

    python benchmarks/text_trim.py [--text 52] [--repeats 5] [--json FILE]

(1) The forward FLOPs of the published Qwen-Image transformer (the adapter's ``forward_flops``) at
``--text`` vs 256 text tokens, at 512^2 and 1024^2. (2) The CPU time of the tiny preset's guided velocity
(two passes) at 128^2 with ``model.max_text_len=256``: the same Cond padded (no host lengths) and trimmed
to its prompts' ``--text`` words; the median of ``--repeats`` calls, and the largest difference of the
two velocities. Measurements of this machine, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from digenrl.adapters import build_adapter
from digenrl.adapters.cond import Cond
from digenrl.adapters.cost_hooks import Tokens
from digenrl.adapters.qwen_image import QWEN_IMAGE, QwenImageAdapter
from digenrl.config.run import load_config

PADDED = 256


def flops_ratio(text: int, side: int) -> dict:
    """Published Qwen-Image, one pass of one sample: image tokens of a ``side``^2 image (8x VAE, 2x2)."""
    x = (side // 16) ** 2
    padded, trimmed = (
        QwenImageAdapter.forward_flops(QWEN_IMAGE.transformer, Tokens(x, t, 0, 0)) for t in (PADDED, text)
    )
    return {
        "side": side,
        "image_tokens": x,
        "tflops_padded": padded / 1e12,
        "tflops_trimmed": trimmed / 1e12,
        "ratio": padded / trimmed,
    }


def cpu_times(text: int, repeats: int, side: int = 128) -> dict:
    cfg = load_config(
        None,
        [
            "model.adapter=qwen_image",
            f"model.height={side}",
            f"model.width={side}",
            f"model.max_text_len={PADDED}",
            "model.lora=null",
            "sampling.guidance=4.0",
        ],
    )
    ad = build_adapter(cfg.model, cfg.sampling)
    words = " ".join(f"w{i}" for i in range(text))
    cond = ad.encode_prompts([words, words])
    x = ad.initial_noise(2, torch.Generator().manual_seed(0))
    sigma = ad.sigma_input(torch.tensor([0.7, 0.7]))
    out, times = {}, {}
    for name, c in (("padded", Cond(cond.batched)), ("trimmed", cond)):
        runs = []
        with torch.no_grad():
            for _ in range(repeats + 1):  # the first call warms up
                t0 = time.perf_counter()
                out[name] = ad.velocity(x, sigma, c)
                runs.append(time.perf_counter() - t0)
        times[name] = statistics.median(runs[1:]) * 1e3
    diff = float((out["padded"] - out["trimmed"]).abs().max())
    return {
        "side": side,
        "ms_padded": times["padded"],
        "ms_trimmed": times["trimmed"],
        "speedup": times["padded"] / times["trimmed"],
        "max_abs_diff": diff,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=int, default=52, help="the prompts' text tokens (flow_grpo OCR: ~52)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = {
        "text": a.text,
        "flops": [flops_ratio(a.text, s) for s in (512, 1024)],
        "cpu": cpu_times(a.text, a.repeats),
    }
    for f in data["flops"]:
        print(
            f"published Qwen-Image {f['side']}^2 ({f['image_tokens']} image tokens): "
            f"{f['tflops_padded']:.1f} vs {f['tflops_trimmed']:.1f} TFLOPs per pass at {PADDED} vs "
            f"{a.text} text tokens: x{f['ratio']:.3f}"
        )
    c = data["cpu"]
    print(
        f"tiny Qwen-Image {c['side']}^2, guided velocity on 1 CPU thread: {c['ms_padded']:.1f} ms padded vs "
        f"{c['ms_trimmed']:.1f} ms trimmed (x{c['speedup']:.2f}); max |dv| {c['max_abs_diff']:.1e}"
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(data, fh, indent=1)
    return data


if __name__ == "__main__":
    main()
