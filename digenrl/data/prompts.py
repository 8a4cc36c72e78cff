"""Prompt sets: a file (one prompt per line, or JSONL with a 'prompt' field and metadata) or built-in.

A JSONL row of an edit prompt set names its input image (``image``: a path relative to the file); the
path travels, resolved, in the prompt's metadata to the adapter's conditioning and to the rewards.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from digenrl.adapters import adapter_class
from digenrl.adapters.edit import image_problem
from digenrl.config.train import PromptsConfig
from digenrl.errors import UserError, read_user_text

_COLORS = ["red", "green", "blue", "yellow"]
_OBJECTS = ["apple", "car", "bird", "house", "flower", "boat"]

BUILTIN: dict[str, list[str]] = {
    # colour x object: the prompt names the colour the prompt_color reward asks for
    "colors": [f"a {c} {o}" for o, c in itertools.product(_OBJECTS, _COLORS)],
}


@dataclass
class Prompt:
    text: str
    meta: dict = field(default_factory=dict)


#: characters per token of the text encoder's limit a prompt may use (English averages ~4 characters a
#: token: a 4x margin), and a floor for the tiny presets' short limits. Longer prompts are refused at load
#: time, naming the file and line: the tokenizer would cut them anyway, and an absurd one (a 10 MB line)
#: would fail much later, in the tokenizer or in Pillow drawing its caption.
CHARS_PER_TOKEN = 16
MIN_PROMPT_CHARS = 1024
#: the limit when no model is known (``load_prompts`` without ``max_chars``)
DEFAULT_PROMPT_CHARS = 16_384


def prompt_char_limit(max_text_len: int) -> int:
    """The longest prompt (characters) for a text encoder that reads ``max_text_len`` tokens."""
    return max(MIN_PROMPT_CHARS, CHARS_PER_TOKEN * max_text_len)


def check_prompts(cfg) -> list[Prompt]:
    """The run's prompts, loaded with the limit its text encoder implies (``model.max_text_len``), their
    input images read and sized against the model's output (an edit family needs one on every row)."""
    model = cfg.model
    edits = adapter_class(model.adapter).edits
    if edits and cfg.prompts.builtin is not None:
        raise UserError(
            f"prompts.builtin: model.adapter {model.adapter} edits images: give prompts.file, a .jsonl "
            "whose rows carry 'prompt' and 'image'"
        )
    return load_prompts(cfg.prompts, prompt_char_limit(model.max_text_len), **image_checks(cfg))


def image_checks(cfg) -> dict:
    """:func:`load_prompts`'s image arguments for a run: its output size, and its family if it edits."""
    model = cfg.model
    edits = adapter_class(model.adapter).edits
    return dict(image_size=(model.height, model.width), edit_family=model.adapter if edits else None)


def _image_path(row: dict, path: Path, n: int, what: str, size: tuple[int, int] | None) -> str:
    """Row ``n``'s input image as an absolute path (relative paths are read from the file's directory);
    with ``size`` = (height, width), the image is read and must be that size."""
    image = row["image"]
    if not isinstance(image, str) or not image.strip():
        raise UserError(f"{what}: {path}:{n}: 'image' must be a path (relative to the file)")
    resolved = str((path.parent / image).resolve())
    if size is not None and (problem := image_problem(resolved, size)) is not None:
        raise UserError(f"{what}: {path}:{n}: {problem}")
    return resolved


def split_file(path: Path, split: str, what: str) -> Path:
    """``path`` itself, or -- a directory in Flow-GRPO's dataset layout -- its ``<split>.txt`` (one
    prompt a line: ocr, pickscore) or ``<split>_metadata.jsonl`` (GenEval metadata rows: geneval)."""
    if not path.is_dir():
        return path
    found = [f for f in (path / f"{split}.txt", path / f"{split}_metadata.jsonl") if f.is_file()]
    if not found:
        raise UserError(
            f"{what}: {path} is a directory, not a file (nor a dataset in Flow-GRPO's layout: it holds no "
            f"{split}.txt or {split}_metadata.jsonl)"
        )
    if len(found) > 1:
        raise UserError(
            f"{what}: {path} holds both {split}.txt and {split}_metadata.jsonl: name the one to use"
        )
    return found[0]


def load_prompts(
    cfg: PromptsConfig,
    max_chars: int = DEFAULT_PROMPT_CHARS,
    what: str = "prompts.file",
    split: str = "train",
    image_size: tuple[int, int] | None = None,
    edit_family: str | None = None,
) -> list[Prompt]:
    """The prompt set; a file's errors name ``what`` (the field or option that named it), the file and
    the line. A prompt must be a non-empty string of at most ``max_chars`` characters. A directory is
    read in Flow-GRPO's layout: its ``split`` (``train`` to train on, ``test`` for ``digenrl eval``).
    ``image_size``: read every row's input image and require this (height, width); ``edit_family``: the
    edit adapter that needs an image on every row."""
    if cfg.builtin is not None:
        if cfg.builtin not in BUILTIN:
            raise UserError(f"prompts.builtin: unknown set '{cfg.builtin}' (available: {', '.join(BUILTIN)})")
        return [Prompt(p) for p in BUILTIN[cfg.builtin]]
    path = split_file(Path(cfg.file), split, what)
    prompts = []
    for n, line in enumerate(read_user_text(path, what).splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
                prompt = Prompt(row.pop("prompt"), row)
            except (json.JSONDecodeError, KeyError, AttributeError, RecursionError):
                raise UserError(f"{what}: {path}:{n}: expected a JSON object with a 'prompt' field") from None
            if not isinstance(prompt.text, str) or not prompt.text.strip():
                raise UserError(f"{what}: {path}:{n}: 'prompt' must be a non-empty string")
            if "image" in row:
                row["image"] = _image_path(row, path, n, what, image_size)
            elif edit_family is not None:
                raise UserError(
                    f"{what}: {path}:{n}: model.adapter {edit_family} edits an input image: the row has "
                    "no 'image'"
                )
        elif edit_family is not None:
            raise UserError(
                f"{what}: {path}:{n}: model.adapter {edit_family} edits an input image: give a .jsonl whose "
                "rows carry 'prompt' and 'image'"
            )
        else:
            prompt = Prompt(line.strip())
        if len(prompt.text) > max_chars:
            raise UserError(
                f"{what}: {path}:{n}: a prompt of {len(prompt.text)} characters, more than the {max_chars} "
                "a prompt may hold (the text encoder reads model.max_text_len tokens); shorten it"
            )
        if "\0" in prompt.text:
            raise UserError(f"{what}: {path}:{n}: the prompt holds a NUL character")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"{what}: {path} holds no prompts")
    return prompts


class PromptSampler:
    """Deterministic prompt choice per iteration: a seeded shuffle of the set, cycled."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed

    def for_iteration(self, iteration: int, n: int) -> list[Prompt]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
        order = torch.randperm(len(self.prompts), generator=g).tolist()
        return [self.prompts[order[i % len(order)]] for i in range(n)]
