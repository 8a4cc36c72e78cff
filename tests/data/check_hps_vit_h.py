"""The ``hpsv2`` reward at full size against HPSv2's own code, outside the suite (it needs torchvision,
as make_hps_tiny.py says, ~12 GB of memory and a few minutes of CPU):

    python tests/data/check_hps_vit_h.py /path/to/HPSv2   # a checkout of github.com/tgxs002/HPSv2

A random ViT-H-14 built by HPSv2's open_clip fork (``create_model("ViT-H-14")``, what ``img_score``
builds), its weights rounded to fp16 and saved as ``{"state_dict": ...}`` (the layout of
HPS_v2.1_compressed.pt); a transformers CLIP tokenizer directory written from the fork's own BPE
file; then the reward with its defaults (``arch: ViT-H-14``) against the fork's ``preprocess_val``,
``tokenize`` and model on three images and prompts. Prints the token ids' agreement, both scores,
and the reward's load and per-image times.
"""

import html
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.library
from PIL import Image

HERE = Path(__file__).parent
PROMPTS = ["a red car", "Two dogs &amp; a cat on the grass, 4k photo", "an astronaut riding a horse"]
SIZES = [(224, 224), (512, 384), (300, 641)]


def main(hpsv2_root: str) -> None:
    torch.library.register_fake = lambda *a, **k: lambda f: f  # see make_hps_tiny.py
    sys.path[:0] = [str(Path(hpsv2_root) / "hpsv2"), str(HERE.parents[1])]
    from src.open_clip import create_model, get_tokenizer, image_transform
    from src.open_clip.tokenizer import _tokenizer

    from digenrl.rewards.hps import HPSv2

    out = Path(tempfile.mkdtemp(prefix="hps-vit-h-"))
    torch.manual_seed(0)
    model = create_model("ViT-H-14", precision="fp32", output_dict=True).eval()
    model.half().float()  # the weights the fp16 file holds
    torch.save({"state_dict": {k: v.half() for k, v in model.state_dict().items()}}, out / "hps.pt")

    from transformers import CLIPTokenizer

    special = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    (out / "vocab.json").write_text(json.dumps({special.get(k, k): v for k, v in _tokenizer.encoder.items()}))
    merges = sorted(_tokenizer.bpe_ranks, key=_tokenizer.bpe_ranks.get)
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    tok_dir = out / "tokenizer"
    CLIPTokenizer.from_pretrained(out).save_pretrained(tok_dir)

    ids = get_tokenizer("ViT-H-14")(PROMPTS)
    cleaned = [html.unescape(html.unescape(p)).strip() for p in PROMPTS]  # as the reward cleans them
    hf = CLIPTokenizer.from_pretrained(tok_dir)(cleaned, padding="max_length", max_length=77, truncation=True)
    eot = [row.index(49407) for row in ids.tolist()]
    same = all(a[: e + 1] == b[: e + 1] for a, b, e in zip(ids.tolist(), hf["input_ids"], eot))
    print("token ids up to <|endoftext|> equal:", same)

    g = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8) for h, w in SIZES]
    preprocess_val = image_transform(224, is_train=False)
    with torch.no_grad():
        ref = []
        for im, p, row in zip(images, PROMPTS, ids):
            o = model(preprocess_val(Image.fromarray(np.asarray(im)))[None], row[None])
            ref.append((o["image_features"] @ o["text_features"].T).item())
    del model

    start = time.perf_counter()
    reward = HPSv2(path=str(out / "hps.pt"), tokenizer=str(tok_dir), device="cpu", batch_size=1)
    loaded = time.perf_counter() - start
    got, seconds = [], []
    for im, p in zip(images, PROMPTS):
        t = time.perf_counter()
        got.append(reward(im.permute(2, 0, 1)[None].float() / 255, [p]).item())
        seconds.append(time.perf_counter() - t)
    print("HPSv2's code:", [round(x, 6) for x in ref])
    print("hpsv2 reward:", [round(x, 6) for x in got])
    print(f"max |diff| {max(abs(a - b) for a, b in zip(ref, got)):.2e}")
    print(
        f"load {loaded:.1f} s; per image {[round(s, 2) for s in seconds]} s (CPU, fp32, torch threads "
        f"{torch.get_num_threads()})"
    )


if __name__ == "__main__":
    main(sys.argv[1])
