"""``hpsv2`` from an open_clip checkpoint: a tiny random OpenCLIP built and scored by HPSv2's own code
(its open_clip fork and ``img_score``'s preprocessing and score; tests/data/make_hps_tiny.py wrote the
two files once, outside the suite), loaded here through the reward's config path."""

from pathlib import Path

import pytest
import torch

from digenrl.config.train import RewardConfig
from digenrl.errors import UserError
from digenrl.rewards import build_reward
from digenrl.rewards.hps import convert_open_clip
from tests.test_model_rewards import make_tiny_clip

DATA = Path(__file__).parent / "data"
TINY_ARCH = dict(
    embed_dim=16, image_size=32, patch_size=8, vision_width=16, vision_layers=2, vision_heads=2,
    text_width=16, text_layers=2, text_heads=2, vocab_size=514,
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tiny_clip(tmp_path_factory.mktemp("tok"))  # the byte-level tokenizer the fixture used


def build(**args):
    return build_reward(RewardConfig(components=[{"name": "hpsv2", "args": args}]))


def test_hpsv2_scores_as_hpsv2s_own_code_on_its_checkpoint_layout(tokenizer):
    ref = torch.load(DATA / "hps_tiny_expected.pt", weights_only=True)
    common = dict(path=str(DATA / "hps_tiny.pt"), tokenizer=str(tokenizer), arch=TINY_ARCH, device="cpu")
    hps, hps100 = build(**common), build(**common, scale=100.0)
    for image, prompt, want in zip(ref["images"], ref["prompts"], ref["scores"]):
        pixels = image.permute(2, 0, 1)[None].float() / 255  # 32x32, resized, odd crop offsets
        total, parts = hps(pixels, [prompt])
        assert total.item() == pytest.approx(want.item(), abs=1e-5)
        assert parts["hpsv2"].item() == total.item()
        assert hps100(pixels, [prompt])[0].item() == pytest.approx(100 * want.item(), abs=1e-3)
    # a batch: each distinct prompt embedded once, scores as one by one
    same = torch.stack([im for im in ref["images"] if im.shape[:2] == (32, 32)] * 3).permute(0, 3, 1, 2)
    batch, _ = hps(same.float() / 255, ["a red car", "a cat", "a red car"])
    assert batch[0] == pytest.approx(ref["scores"][0].item(), abs=1e-5) and batch[0] == batch[2]
    assert ref["scores"].std() > 0.1  # the reference scores differ: equality above is not by chance


def test_conversion_splits_attention_and_transposes_projections():
    d = 4
    qkv = torch.arange(3 * d * d, dtype=torch.float32).view(3 * d, d)
    proj = torch.randn(d, 2)
    out = convert_open_clip(
        {"visual.transformer.resblocks.1.attn.in_proj_weight": qkv, "visual.proj": proj,
         "transformer.resblocks.0.mlp.c_fc.bias": torch.ones(8)}
    )  # fmt: skip
    v = "vision_model.encoder.layers.1.self_attn."
    assert torch.equal(out[v + "q_proj.weight"][1], qkv[:d])
    assert torch.equal(out[v + "v_proj.weight"][1], qkv[2 * d :])
    assert torch.equal(out["visual_projection.weight"][1], proj.T)
    assert out["text_model.encoder.layers.0.mlp.fc1.bias"][0] == "transformer.resblocks.0.mlp.c_fc.bias"


def test_wrong_checkpoint_or_args_is_one_line_naming_the_arg(tokenizer, tmp_path):
    ckpt, tok = str(DATA / "hps_tiny.pt"), str(tokenizer)
    cases = [
        (dict(path=ckpt, tokenizer=tok, device="cpu"),  # the default arch, ViT-H-14
         r"args\.path: reward 'hpsv2': .*hps_tiny\.pt is not an open_clip ViT-H-14 checkpoint: "
         r"positional_embedding has shape \(77, 16\), ViT-H-14 needs \(77, 1024\)"),
        (dict(path=str(tmp_path / "no.pt"), tokenizer=tok), r"args\.path: .*file .*no\.pt not found"),
        (dict(tokenizer=tok), r"args\.path: reward 'hpsv2': required"),
        (dict(path=ckpt), r"args\.tokenizer: .*required"),
        (dict(path=ckpt, tokenizer=tok, arch="ViT-Q-99"), r"args\.arch: reward 'hpsv2': unknown 'ViT-Q-99'"),
        (dict(path=ckpt, tokenizer=tok, arch=TINY_ARCH | {"vocab_size": 500}), r"tokenizer: .*514 tokens"),
    ]  # fmt: skip
    layer_scaled = torch.load(ckpt, weights_only=True)["state_dict"] | {"visual.ls_1.gamma": torch.ones(16)}
    torch.save({"state_dict": layer_scaled}, tmp_path / "ls.pt")
    cases.append(
        (dict(path=str(tmp_path / "ls.pt"), tokenizer=tok, arch=TINY_ARCH), r"unexpected visual\.ls_1\.gamma")
    )
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    cases.append((dict(path=str(tmp_path / "junk.pt"), tokenizer=tok), r"args\.path: .*cannot read"))
    for args, message in cases:
        with pytest.raises(UserError, match=message) as info:
            build(**args)
        assert "\n" not in str(info.value)
