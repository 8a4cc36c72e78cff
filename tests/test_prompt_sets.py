"""Prompt sets as the peers ship them: Flow-GRPO's dataset directories (``train.txt`` / ``test.txt``;
GenEval's ``train_metadata.jsonl`` / ``test_metadata.jsonl``) and GenEval's metadata rows."""

import json

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
