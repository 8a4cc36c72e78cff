"""Prompt sets: a file (one prompt per line, or JSONL with a 'prompt' field and metadata) or built-in.

A JSONL row of an edit prompt set names its input image (``image``: a path relative to the file); the
path travels, resolved, in the prompt's metadata to the adapter's conditioning and to the rewards.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from digenrl.adapters import adapter_class
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
    notes: list[str] = []
    prompts = load_prompts(
        cfg.prompts, prompt_char_limit(model.max_text_len), notes=notes, **image_checks(cfg)
    )
    say_notes(notes)
    return prompts


def image_checks(cfg) -> dict:
    """:func:`load_prompts`'s image arguments for a run: its output size (an edit family's input images
    must have it; other families do not read them), and its family."""
    model = cfg.model
    edits = adapter_class(model.adapter).edits
    return dict(image_size=(model.height, model.width) if edits else None, family=model.adapter, edits=edits)


_SAID: set[str] = set()


def say_notes(notes: list[str]) -> None:
    """Print each note once per process (train and validate load the prompts more than once)."""
    for note in notes:
        if note not in _SAID:
            _SAID.add(note)
            print(f"note: {note}", file=sys.stderr)


def _image_mode(path: str, size: tuple[int, int]) -> tuple[str | None, str]:
    """(why the image at ``path`` cannot condition a ``size`` = (height, width) sample or None, its PIL
    mode). Every image is fully decoded: a truncated file is refused here, not mid-run."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.load()
            mode, height, width = img.mode, img.height, img.width
    except FileNotFoundError:
        return f"image not found: {path}", ""
    except (OSError, ValueError, SyntaxError) as e:  # PIL: UnidentifiedImageError, truncated data
        return f"image unreadable: {path} ({type(e).__name__})", ""
    if (height, width) != tuple(size):
        return (
            f"image {path} is {height}x{width}, the model generates {size[0]}x{size[1]} "
            "(model.height x model.width): resize it"
        ), mode
    return None, mode


def _image_path(row: dict, path: Path, n: int, what: str, size, modes: dict) -> str:
    """Row ``n``'s input image as an absolute path (relative paths are read from the file's directory);
    with ``size`` = (height, width), the image is read and must be that size (``modes``: row numbers of
    the images that are not RGB, by PIL mode)."""
    image = row["image"]
    if not isinstance(image, str) or not image.strip():
        raise UserError(f"{what}: {path}:{n}: 'image' must be a path (relative to the file)")
    resolved = str((path.parent / image).resolve())
    if size is not None:
        problem, mode = _image_mode(resolved, size)
        if problem is not None:
            raise UserError(f"{what}: {path}:{n}: {problem}")
        if mode != "RGB":
            modes.setdefault(mode, []).append(n)
    return resolved


BOM = "\ufeff"
BOM_PROBLEM = "starts with a UTF-8 byte-order mark (BOM); save the file as UTF-8 without one"
_JSON_TYPES = {list: "a JSON array", str: "a JSON string", int: "a JSON number", float: "a JSON number"}


def _json_row(line: str, path: Path, n: int, what: str) -> dict:
    """Row ``n`` of a .jsonl prompt file as an object with a 'prompt', or one line saying what is wrong."""
    where = f"{what}: {path}:{n}"
    if line.startswith(BOM):
        raise UserError(f"{where}: {BOM_PROBLEM}")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: invalid JSON at column {exc.colno} ({exc.msg})") from None
    except RecursionError:
        raise UserError(f"{where}: invalid JSON (nested too deep)") from None
    if not isinstance(row, dict):
        kind = (
            "JSON null"
            if row is None
            else "a JSON boolean"
            if isinstance(row, bool)
            else _JSON_TYPES[type(row)]
        )
        raise UserError(f"{where}: {kind}, not an object with a 'prompt' field")
    if "prompt" not in row:
        raise UserError(
            f"{where}: the object has no 'prompt' field (it has {', '.join(map(repr, row)) or 'none'})"
        )
    return row


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
    family: str | None = None,
    edits: bool = False,
    notes: list[str] | None = None,
) -> list[Prompt]:
    """The prompt set; a file's errors name ``what`` (the field or option that named it), the file and
    the line. A prompt must be a non-empty string of at most ``max_chars`` characters. A directory is
    read in Flow-GRPO's layout: its ``split`` (``train`` to train on, ``test`` for ``digenrl eval``).
    ``image_size``: read every row's input image and require this (height, width); ``family``: the model
    adapter, which needs an image on every row when it ``edits``; ``notes``: what the user should know
    (non-RGB images converted, images a non-edit family ignores) is appended there."""
    edit_family = family if edits else None
    modes: dict[str, list[int]] = {}
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
            row = _json_row(line, path, n, what)
            prompt = Prompt(row.pop("prompt"), row)
            if not isinstance(prompt.text, str) or not prompt.text.strip():
                raise UserError(f"{what}: {path}:{n}: 'prompt' must be a non-empty string")
            if "image" in row:
                row["image"] = _image_path(row, path, n, what, image_size, modes)
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
            if line.startswith(BOM):
                raise UserError(f"{what}: {path}:{n}: {BOM_PROBLEM}")
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
    if notes is not None:
        notes += _image_notes(path, what, modes, family, edits, prompts)
    return prompts


def _image_notes(path: Path, what: str, modes: dict, family, edits: bool, prompts: list[Prompt]) -> list[str]:
    out = []
    if modes:
        rows = sorted(n for ns in modes.values() for n in ns)
        out.append(
            f"{what}: {path}: {len(rows)} input image(s) are not RGB ({', '.join(sorted(modes))}; first on "
            f"row {rows[0]}): converted to RGB as the edit pipelines do (an alpha channel is dropped)"
        )
    if family is not None and not edits and any("image" in p.meta for p in prompts):
        out.append(
            f"{what}: {path}: model.adapter {family} does not edit: the rows' input images are not given "
            "to the model (only a reward that reads 'image', e.g. source_similarity, sees them)"
        )
    return out


class PromptSampler:
    """Deterministic prompt choice per iteration: a seeded shuffle of the set, cycled."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed

    def for_iteration(self, iteration: int, n: int) -> list[Prompt]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
        order = torch.randperm(len(self.prompts), generator=g).tolist()
        return [self.prompts[order[i % len(order)]] for i in range(n)]
