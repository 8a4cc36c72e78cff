"""Prompt sets: a file (one prompt per line, or JSONL with a 'prompt' field and metadata) or built-in."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from digenrl.config import PromptsConfig
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


def load_prompts(cfg: PromptsConfig) -> list[Prompt]:
    if cfg.builtin is not None:
        if cfg.builtin not in BUILTIN:
            raise UserError(f"prompts.builtin: unknown set '{cfg.builtin}' (available: {', '.join(BUILTIN)})")
        return [Prompt(p) for p in BUILTIN[cfg.builtin]]
    path = Path(cfg.file)
    if not path.is_file():
        raise UserError(f"prompts.file: {path} not found")
    prompts = []
    for n, line in enumerate(read_user_text(path, "prompts.file").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
                prompts.append(Prompt(row.pop("prompt"), row))
            except (json.JSONDecodeError, KeyError, AttributeError):
                raise UserError(
                    f"prompts.file: {path}:{n}: expected a JSON object with a 'prompt' field"
                ) from None
        else:
            prompts.append(Prompt(line.strip()))
    if not prompts:
        raise UserError(f"prompts.file: {path} holds no prompts")
    return prompts


class PromptSampler:
    """Deterministic prompt choice per iteration: a seeded shuffle of the set, cycled."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed

    def for_iteration(self, iteration: int, n: int) -> list[Prompt]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
        order = torch.randperm(len(self.prompts), generator=g).tolist()
        return [self.prompts[order[i % len(order)]] for i in range(n)]
