"""Seconds per image of the ``ocr`` reward (PP-OCRv4 via rapidocr-onnxruntime) at 64, 256 and 512 px.

One ONNX Runtime thread per session (the reward's default), as a rollout worker or the reward service
runs it. Each size is timed on rendered text (three words; one at 64 px) and on noise (the detector
finds nothing, so recognition is skipped); the median of ``--repeats`` calls after one warm-up. Also
reports the process's threads and resident memory once the model is loaded and has read every image.
Run::

    python benchmarks/ocr_reward.py [--sizes 64 256 512] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def text_for(side: int) -> str:
    return "Hello" if side < 128 else "Fresh Bread Daily"  # legible: 3 words do not fit in 64 px


def text_image(side: int, text: str) -> torch.Tensor:
    """Black ``text`` on white, about 80% of the image's width."""
    img = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.truetype(FONT, 100)
    font = ImageFont.truetype(FONT, max(8, int(100 * 0.8 * side / draw.textlength(text, font=font))))
    draw.text((side // 10, side // 3), text, fill="black", font=font)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255


def process_threads_rss() -> tuple[int, float]:
    """This process's thread count and resident memory in MiB (Linux /proc)."""
    status = Path("/proc/self/status").read_text().splitlines()
    field = {k: v.split() for k, v in (line.split(":", 1) for line in status)}
    return int(field["Threads"][0]), int(field["VmRSS"][0]) / 1024


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from digenrl.rewards.ocr import OcrReward

    threads0, rss0 = process_threads_rss()
    reward = OcrReward(threads=args.threads)
    rows = []
    for side in args.sizes:
        row = {"side": side}
        noise = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(side))
        prompt = [f'a sign that says "{text_for(side)}"']
        for kind, img in (("text", text_image(side, text_for(side))[None]), ("noise", noise)):
            score = reward(img, prompt).item()  # warm-up (and the model load, on the first)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                reward(img, prompt)
                times.append(time.perf_counter() - t0)
            row[f"{kind}_s"], row[f"{kind}_score"] = statistics.median(times), score
        rows.append(row)
        print(
            f"{side:4d} px  text {row['text_s'] * 1e3:7.1f} ms (score {row['text_score']:.3f})"
            f"   noise {row['noise_s'] * 1e3:7.1f} ms (score {row['noise_score']:.3f})"
        )
    threads1, rss1 = process_threads_rss()
    out = {
        "threads_per_session": args.threads,
        "rows": rows,
        "process_threads_before": threads0,
        "process_threads_after": threads1,
        "rss_mib_before": rss0,
        "rss_mib_after": rss1,
    }
    print(f"process threads {threads0} -> {threads1}, RSS {rss0:.0f} -> {rss1:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
