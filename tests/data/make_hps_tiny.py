"""Writes hps_tiny.pt (a tiny random OpenCLIP, in the layout HPS_v2.1_compressed.pt ships:
``{"state_dict": ...}``) and hps_tiny_expected.pt (images, prompts, and their scores by HPSv2's own code:
its open_clip fork's ``CLIP`` and ``image_transform(is_train=False)``, then ``img_score.score``'s
``diag(image_features @ text_features.T)``) for tests/test_hps_reward.py. Run once, outside the suite:

    python tests/data/make_hps_tiny.py /path/to/HPSv2   # a checkout of github.com/tgxs002/HPSv2

It needs torchvision. The one built for torch 2.13.0 on the package index is a CUDA build whose
compiled ops do not load beside the CPU torch; its transforms are pure Python, so the fake-kernel
registrations that need those ops are skipped below.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.library
from PIL import Image

HERE = Path(__file__).parent
ARCH = dict(embed_dim=16, image_size=32, patch_size=8, width=16, layers=2, heads=2, vocab_size=514)
PROMPTS = ["a red car", "two dogs &amp; a cat on the grass", "a red car", "an astronaut riding a horse"]
SIZES = [(32, 32), (40, 48), (64, 37), (33, 90)]  # (h, w): no resize, resize, odd crop offsets


def main(hpsv2_root: str) -> None:
    torch.library.register_fake = lambda *a, **k: lambda f: f  # see the docstring
    sys.path[:0] = [str(Path(hpsv2_root) / "hpsv2"), str(HERE.parents[1])]
    from src.open_clip.model import CLIP
    from src.open_clip.transform import image_transform

    from tests.test_model_rewards import make_tiny_clip  # its byte-level tokenizer (vocab 514)

    a = ARCH
    torch.manual_seed(0)
    model = CLIP(
        embed_dim=a["embed_dim"],
        vision_cfg=dict(
            image_size=a["image_size"],
            layers=a["layers"],
            width=a["width"],
            head_width=a["width"] // a["heads"],
            patch_size=a["patch_size"],
        ),
        text_cfg=dict(
            context_length=77,
            vocab_size=a["vocab_size"],
            width=a["width"],
            heads=a["heads"],
            layers=a["layers"],
        ),
        output_dict=True,
    ).eval()
    with torch.no_grad():  # open_clip zero-inits some biases: make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    torch.save({"epoch": 1, "state_dict": model.state_dict()}, HERE / "hps_tiny.pt")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_clip(Path(tempfile.mkdtemp()) / "tok"))
    # HPSv2's tokenize(): [sot] + bpe(clean(text)) + [eot], zero-padded to 77
    import html

    ids = torch.zeros(len(PROMPTS), 77, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        row = [
            tok.bos_token_id,
            *tok.encode(html.unescape(html.unescape(p)).strip(), add_special_tokens=False),
            tok.eos_token_id,
        ]
        ids[i, : len(row)] = torch.tensor(row)
    g = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8) for h, w in SIZES]
    preprocess_val = image_transform(a["image_size"], is_train=False)
    pixels = torch.stack([preprocess_val(Image.fromarray(np.asarray(im))) for im in images])
    with torch.no_grad():
        out = model(pixels, ids)
        scores = torch.diagonal(out["image_features"] @ out["text_features"].T)
    torch.save(
        {"images": images, "prompts": PROMPTS, "scores": scores, "arch": a}, HERE / "hps_tiny_expected.pt"
    )
    print("scores", scores.tolist())


if __name__ == "__main__":
    main(sys.argv[1])
