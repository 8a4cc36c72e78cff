"""Prompt sets as the peers ship them: Flow-GRPO's dataset directories (``train.txt`` / ``test.txt``;
GenEval's ``train_metadata.jsonl`` / ``test_metadata.jsonl``) and GenEval's metadata rows."""

import json
from pathlib import Path

import pytest

from digenrl.config.train import PromptsConfig
from digenrl.data.prompts import load_prompts
from digenrl.errors import UserError

ROW = {
    "tag": "counting",
    "include": [{"class": "cat", "count": 2}],
    "exclude": [{"class": "cat", "count": 3}],
}


def test_flow_grpo_directories_by_split(tmp_path):
    ocr = tmp_path / "ocr"
    ocr.mkdir()
    (ocr / "train.txt").write_text('a sign that says "Open"\na mug reading "Hi"\n')
    (ocr / "test.txt").write_text('a poster reading "Sale"\n')
    assert [p.text for p in load_prompts(PromptsConfig(file=ocr))] == [
        'a sign that says "Open"',
        'a mug reading "Hi"',
    ]
    assert [p.text for p in load_prompts(PromptsConfig(file=ocr), split="test")] == [
        'a poster reading "Sale"'
    ]

    geneval = tmp_path / "geneval"
    geneval.mkdir()
    (geneval / "train_metadata.jsonl").write_text(json.dumps({**ROW, "prompt": "a photo of two cats"}) + "\n")
    (geneval / "test_metadata.jsonl").write_text(json.dumps({**ROW, "prompt": "two cats"}) + "\n")
    (got,) = load_prompts(PromptsConfig(file=geneval))
    assert got.text == "a photo of two cats" and got.meta == ROW  # the row less its prompt: the metadata
    assert load_prompts(PromptsConfig(file=geneval), split="test")[0].text == "two cats"


def test_a_directory_without_the_split_or_with_both_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"is a directory, not a file \(nor a dataset in Flow-GRPO's layout"):
        load_prompts(PromptsConfig(file=tmp_path))
    (tmp_path / "train.txt").write_text("a\n")
    (tmp_path / "train_metadata.jsonl").write_text(json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(UserError, match=r"holds both train\.txt and train_metadata\.jsonl"):
        load_prompts(PromptsConfig(file=tmp_path))


def test_eval_means_per_tag_by_hand():
    import torch

    from digenrl.run.evaluate import EvalResult

    nan = float("nan")
    res = EvalResult(
        prompts=["a", "b", "c", "d", "e"],
        pixels=torch.zeros(5, 3, 2, 2, dtype=torch.uint8),
        scores={"geneval": torch.tensor([1.0, 0.0, 1.0, 1.0, nan])},
        total=torch.tensor([1.0, 0.0, 1.0, 1.0, nan]),
        tags=["counting", "counting", "position", "colors", "colors"],
    )
    r = res.rewards()["geneval"]
    # counting 1/2, position 1, colors 1 (its NaN left out); GenEval's overall: the mean of the tags'
    assert r["by_tag"] == {"counting": 0.5, "position": 1.0, "colors": 1.0}
    assert r["tag_mean"] == pytest.approx(2.5 / 3) and r["mean"] == pytest.approx(3 / 4)
    untagged = EvalResult(["a"], torch.zeros(1, 3, 2, 2), {"x": torch.ones(1)}, torch.ones(1), tags=[None])
    assert "by_tag" not in untagged.rewards()["x"]


def test_non_rgb_input_images_are_converted_with_one_note(tmp_path, capsys):
    """Grayscale, RGBA and palette input images are accepted (the edit pipelines convert them to RGB)
    and the user is told once, naming the file, the modes and the first row."""
    from PIL import Image

    from digenrl.config.run import load_config
    from digenrl.data.prompts import check_prompts

    for name, mode, fill in [
        ("ok", "RGB", (1, 2, 3)),
        ("g", "L", 9),
        ("a", "RGBA", (1, 2, 3, 4)),
        ("p", "P", 3),
    ]:
        Image.new(mode, (32, 32), fill).save(tmp_path / f"{name}.png")
    rows = [{"prompt": "make it red", "image": f"{n}.png"} for n in ("ok", "g", "a", "p")]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = ["model.adapter=flux_kontext", "model.lora.targets=null", f"prompts.file={tmp_path}/e.jsonl"]
    cfg = load_config(None, sets)
    assert len(check_prompts(cfg)) == 4
    check_prompts(cfg)  # a second load (train checks twice) says nothing new
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "e.jsonl: 3 input image(s) are not RGB (L, P, RGBA; first on row 2): converted to RGB" in err


def test_a_family_that_ignores_input_images_says_so_and_does_not_size_them(tmp_path, capsys):
    """SD3 on an edit set: the images are never given to the model, so their size is not refused (it
    was, before issue 56), and the user is told once that they are ignored."""
    from PIL import Image

    from digenrl.config.run import load_config
    from digenrl.data.prompts import check_prompts

    Image.new("RGB", (8, 8)).save(tmp_path / "small.png")
    (tmp_path / "e.jsonl").write_text(json.dumps({"prompt": "a red car", "image": "small.png"}) + "\n")
    cfg = load_config(Path("configs/sd3_tiny.yaml"), [f"prompts.file={tmp_path}/e.jsonl"])
    (prompt,) = check_prompts(cfg)
    assert prompt.meta["image"] == str(tmp_path / "small.png")  # a reward may still read it
    err = capsys.readouterr().err
    assert "model.adapter sd3 does not edit: the rows' input images are not given to the model" in err
