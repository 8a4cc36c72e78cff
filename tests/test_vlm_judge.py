"""The ``vlm_judge`` reward against a chat-completions server on 127.0.0.1 (the OpenAI request and
response format vLLM and SGLang serve): images as data URLs, the score parsed from the reply, a
reply with no score under both NaN policies, and a server that stalls."""

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from digenrl.config.train import RewardConfig
from digenrl.errors import UserError
from digenrl.rewards import build_reward
from digenrl.rewards.vlm_judge import DEFAULT_PATTERN, parse_score


class Chat(BaseHTTPRequestHandler):
    """``POST /v1/chat/completions``: replies "Score: <10 x the image's mean brightness>", or what
    ``server.mode`` says: "noscore" (prose without a number), "stall" (sleeps past the timeout)."""

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, dict(self.headers), req))
        if self.server.mode == "stall":
            time.sleep(1.0)
            return
        text, image = req["messages"][0]["content"]
        url = image["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))), dtype=np.float32)
        reply = f"The image is fine.\nScore: {10 * pixels.mean() / 255:.3f}"
        if self.server.mode == "noscore" and "NOSCORE" in text["text"]:
            reply = "I cannot judge this image."
        getattr(self.server, "replies", []).append(reply)  # kept where the server keeps them
        body = json.dumps(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": req["model"],
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Chat)
    srv.requests, srv.mode = [], "ok"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


def judge(server, nan_policy="fail", **args):
    url = f"http://127.0.0.1:{server.server_port}/v1/chat/completions"
    comp = {"name": "vlm_judge", "args": {"url": url, "model": "qwen-vl", "retries": 0, **args}}
    return build_reward(RewardConfig(components=[comp], nan_policy=nan_policy))


def grey(*levels) -> torch.Tensor:
    return torch.stack([torch.full((3, 8, 8), v) for v in levels])


def test_parse_score():
    import re

    p = re.compile(DEFAULT_PATTERN)
    assert parse_score("Score: 7", p) == 7.0 and parse_score("reasoning...\nSCORE = 7.5/10", p) == 7.5
    assert parse_score("score: -1", p) == -1.0
    assert np.isnan(parse_score("no number here", p)) and np.isnan(parse_score("", p))


def test_images_go_as_data_urls_and_scores_come_back_in_order(server):
    server.mode = "ok"
    reward = judge(server, concurrency=3)
    levels = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    _, parts = reward(grey(*levels), [f"prompt {i}" for i in range(6)])
    # 10 x the mean of the 8-bit PNG the server decoded
    want = [10 * round(v * 255) / 255 for v in levels]
    assert parts["vlm_judge"].tolist() == pytest.approx(want, abs=1e-3)
    path, headers, req = server.requests[-1]
    assert path == "/v1/chat/completions" and req["model"] == "qwen-vl" and req["temperature"] == 0
    assert req["messages"][0]["role"] == "user"
    sent = sorted(r["messages"][0]["content"][0]["text"] for _, _, r in server.requests[-6:])
    assert all(f'prompt "prompt {i}"' in t for i, t in enumerate(sent))  # the rubric's {prompt}, each once


def test_a_reply_with_no_score_is_nan_under_the_nan_policy(server):
    server.mode = "noscore"
    prompts = ["a cat", "NOSCORE", "a dog"]
    with pytest.raises(UserError, match=r"reward 'vlm_judge' returned NaN for 1 of 3 samples"):
        judge(server)(grey(0.1, 0.2, 0.3), prompts)
    total, parts = judge(server, nan_policy="drop")(grey(0.1, 0.2, 0.3), prompts)
    got = parts["vlm_judge"]
    assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2]]).all() and torch.isnan(total[1])


def test_a_stalled_server_times_out_retries_then_one_line(server):
    server.mode = "stall"
    n = len(server.requests)
    reward = judge(server, timeout=0.3, retries=1, backoff=0.01)
    with pytest.raises(
        UserError,
        match=r"^reward 'vlm_judge' at http://127\.0\.0\.1:\d+/v1/chat/completions: "
        r"no answer within 0\.3 s \(after 2 tries\)$",
    ):
        reward(grey(0.5), ["a cat"])
    assert len(server.requests) - n == 2  # the first try and one retry
    server.mode = "ok"


def test_bad_args_are_one_line(server):
    with pytest.raises(UserError, match=r"reward\.components\.0\.args\.model: "):
        judge(server, model="")
    with pytest.raises(UserError, match=r"args\.score_pattern: reward 'vlm_judge': needs a group"):
        judge(server, score_pattern=r"score: \d+")
    with pytest.raises(
        UserError, match=r"args\.rubric: reward 'vlm_judge': must be a string holding \{prompt\}"
    ):
        judge(server, rubric="rate it")
    with pytest.raises(UserError, match=r"args\.api_key_env: .*DIGENRL_NO_SUCH_KEY is not set"):
        judge(server, api_key_env="DIGENRL_NO_SUCH_KEY")
