"""Text tokens per pass the planner counts: the adapter's own at ``model.max_text_len``, or, for a family
whose forwards trim the text to their rows' longest valid prompt (``Adapter.trims_text``: Qwen-Image),
the run's prompts.

Details: docs/modules.md, `digenrl.planner.text_tokens`.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from digenrl.adapters import adapter_class
from digenrl.config.train import PromptsConfig
from digenrl.data.prompts import load_prompts
from digenrl.errors import UserError

#: a checkpoint's tokenizer is not loaded: English averages ~4.5 characters a Qwen2 token
CHARS_PER_QWEN_TOKEN = 4.5
#: Qwen-Image's chat template after the dropped 34-token prefix: "<|im_end|>\n<|im_start|>assistant\n"
QWEN_TEMPLATE_SUFFIX = 5


def prompt_tokens(model, text: str) -> int:
    """One prompt's text tokens as the family's encoder keeps them (tiny preset: its stand-in's words;
    a checkpoint: the characters over ``CHARS_PER_QWEN_TOKEN`` plus the template's suffix), capped."""
    if model.pretrained is None and model.preset == "tiny":
        n = max(1, len(text.lower().replace(",", " ").replace(".", " ").split()))  # HashTextEncoder
    else:
        n = math.ceil(len(text) / CHARS_PER_QWEN_TOKEN) + QWEN_TEMPLATE_SUFFIX
    return min(n, model.max_text_len)


def text_tokens(cfg) -> tuple[int, str] | None:
    """(text tokens per pass, where the number comes from) for a family whose forwards trim the text:
    the mean over the prompt set (a call runs its rows' longest: a little more); with true CFG run
    sequentially, the mean of the prompt's pass and the negative prompt's (each pass its own length;
    batched CFG: both at the longer). None -- the adapter's own count at ``model.max_text_len`` stands
    -- when the family pads, edits (the input image's vision tokens are text too), or no prompt file is
    there (a built-in set stands in for the real prompts)."""
    m = cfg.model
    adapter = adapter_class(m.adapter)
    if not adapter.trims_text or adapter.edits or cfg.prompts.file is None:
        return None
    texts = _prompt_texts(cfg.prompts.file)
    if not texts:
        return None
    n = sum(prompt_tokens(m, t) for t in texts) / len(texts)
    source = f"mean of {len(texts)} prompts"
    if cfg.sampling.guidance > 1 and cfg.sampling.cfg_batching != "batched":
        n = (n + prompt_tokens(m, cfg.sampling.negative_prompt or " ")) / 2
        source += " and the negative prompt"
    return max(1, round(n)), source


@lru_cache(maxsize=8)
def _prompt_texts(file: Path) -> tuple[str, ...]:
    """The prompt file's texts; () where it is not there (or does not read)."""
    if not Path(file).exists():
        return ()
    try:
        return tuple(p.text for p in load_prompts(PromptsConfig(builtin=None, file=file)))
    except UserError:
        return ()
