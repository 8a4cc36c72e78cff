"""``vlm_judge``: a vision-language model served behind the OpenAI-compatible chat-completions API
(``vllm serve``, SGLang, ...) grades each image against a rubric; the score is read from its reply.

Details: docs/modules.md, `digenrl.rewards.vlm_judge`.
"""

from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from digenrl.rewards.base import RewardArgError, register
from digenrl.rewards.remote import RemoteReward, _positive, encode_png

DEFAULT_RUBRIC = (
    'Rate how well this image matches the prompt "{prompt}" and how good it looks, from 0 (not at all) '
    "to 10 (perfectly). Answer with one line: Score: <number>"
)
#: "Score: 7", "score = 7.5", "SCORE: -1" (case-insensitive); its first group is the number
DEFAULT_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"


def parse_score(text: str, pattern: re.Pattern) -> float:
    """The number the pattern's first group captures in ``text``; NaN when it does not match."""
    m = pattern.search(text or "")
    return float(m.group(1)) if m else math.nan


@register("vlm_judge")
class VlmJudge(RemoteReward):
    """``args``: ``url``, ``model`` (the served model's name), ``rubric``, ``score_pattern``,
    ``max_tokens``, ``temperature``, ``concurrency``, ``api_key_env`` (an environment variable holding
    a bearer token, if the server wants one), and ``remote``'s ``timeout`` / ``retries`` / ``backoff``."""

    def __init__(
        self,
        url: str | None = None,
        model: str | None = None,
        rubric: str = DEFAULT_RUBRIC,
        score_pattern: str = DEFAULT_PATTERN,
        max_tokens: int = 64,
        temperature: float = 0.0,
        concurrency: int = 8,
        api_key_env: str | None = None,
        timeout: float = 120.0,
        retries: int = 2,
        backoff: float = 1.0,
    ):
        super().__init__(url=url, timeout=timeout, retries=retries, backoff=backoff)
        if not isinstance(model, str) or not model:
            raise RewardArgError(
                "model", "the served model's name is required (vllm serve's --served-model-name)"
            )
        try:
            self.pattern = re.compile(score_pattern)
        except (re.error, TypeError) as exc:
            raise RewardArgError("score_pattern", f"not a regular expression ({exc})") from None
        if self.pattern.groups < 1:
            raise RewardArgError("score_pattern", "needs a group capturing the number, e.g. score: (\\d+)")
        if not isinstance(rubric, str) or "{prompt}" not in rubric:
            raise RewardArgError("rubric", "must be a string holding {prompt}")
        self.model, self.rubric = model, rubric
        self.max_tokens = _positive("max_tokens", max_tokens, int)
        self.temperature = _positive("temperature", temperature, allow_zero=True)
        self.concurrency = _positive("concurrency", concurrency, int)
        self.headers = {}
        if api_key_env:
            if not os.environ.get(api_key_env):
                raise RewardArgError("api_key_env", f"the environment variable {api_key_env} is not set")
            self.headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
        self.replies: list[str] = []  # the latest call's replies, per sample

    def request(self, image: torch.Tensor, prompt: str) -> dict:
        """The chat-completions request for one image."""
        content = [
            {"type": "text", "text": self.rubric.replace("{prompt}", prompt)},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + encode_png(image)}},
        ]
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

    def _reply(self, image, prompt) -> str:
        data = self._post_with_retries(json.dumps(self.request(image, prompt)).encode())
        try:
            content = json.loads(data)["choices"][0]["message"]["content"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError):
            head = data[:80].decode(errors="replace").replace("\n", " ")
            raise self._error(f"not a chat-completions answer (starts {head!r})") from None
        return content if isinstance(content, str) else ""

    def score(self, images, prompts, metadata):
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            self.replies = list(pool.map(self._reply, images, prompts))
        return torch.tensor([parse_score(r, self.pattern) for r in self.replies], dtype=torch.float32)
