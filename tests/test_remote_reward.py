"""The ``remote`` reward against real HTTP servers on 127.0.0.1 (stdlib ThreadingHTTPServer in a thread):
its scores equal a local computation of the same function; a server that is down, slow, answers
garbage or the wrong count stops the run with one line (or the configured retry succeeds); and
no unit is ever trained on missing scores."""

import contextlib
import importlib.util
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from digenrl.config.train import RewardConfig
from digenrl.errors import UserError
from digenrl.rewards import build_reward
from digenrl.rewards.basic import COLORS, PromptColor, prompt_color
from digenrl.rewards.remote import RemoteReward, RemoteRewardError
from tests.helpers import TINY_IMAGE, as_sets

SERVER_FILE = Path(__file__).parents[1] / "benchmarks" / "reward_server.py"
_spec = importlib.util.spec_from_file_location("reward_server", SERVER_FILE)
reward_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reward_server)


def numpy_prompt_color(images, prompts, metadata):
    """prompt_color written again in numpy (server side): 1 - mean RGB distance to the named colour /
    sqrt(3)."""
    out = []
    for img, p, m in zip(images, prompts, metadata):
        target = np.array(COLORS[prompt_color(p, m)], dtype=np.float32)[:, None, None]
        out.append(float(1 - (np.linalg.norm(img - target, axis=0) / 3**0.5).mean()))
    return out


class Server:
    """The shipped example server (benchmarks/reward_server.py) with a scoring function, counting calls."""

    def __init__(self, score_fn=numpy_prompt_color):
        self.calls, self.batches = 0, []

        def counted(images, prompts, metadata):
            self.calls += 1
            self.batches.append(len(prompts))
            return score_fn(images, prompts, metadata)

        self.httpd = reward_server.make_server(counted, "127.0.0.1", 0)
        self.thread = reward_server.serve_in_thread(self.httpd)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


def raw_server(respond):
    """A server whose every answer is ``respond(request_number) -> (status, body bytes)``."""
    count = {"n": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            count["n"] += 1
            status, body = respond(count["n"])
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = _QuietServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}/", count


class _QuietServer(ThreadingHTTPServer):
    """A client that gives up (the timeout tests) closes its socket mid-answer; the stdlib server would
    print that traceback into whichever test's captured stderr runs next."""

    def handle_error(self, request, client_address):
        pass


@contextlib.contextmanager
def nothing_listens():
    """A URL whose port is held by a bound socket that does not listen: connections are refused, and
    no other process on the machine can take the port meanwhile (a closed port could be reused)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    finally:
        sock.close()


def batch(n=6, seed=0):
    pixels = torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    prompts = [f"a {c} car" for c in ("red", "green", "blue")] * (n // 3)
    return pixels, prompts, [{} for _ in prompts]


def test_scores_equal_the_local_function_png_and_array(server):
    pixels, prompts, metas = batch()
    quantised = (pixels * 255).round() / 255  # a PNG carries 8-bit pixels
    png = RemoteReward(url=server.url, batch_size=4)(pixels, prompts, metas)
    assert torch.allclose(png, PromptColor()(quantised, prompts, metas), atol=1e-6)
    assert server.batches == [4, 2]  # batch_size splits the requests
    arr = RemoteReward(url=server.url, format="array")(pixels, prompts, metas)
    assert torch.allclose(arr, PromptColor()(pixels, prompts, metas), atol=1e-6)
    assert not torch.allclose(arr, png, atol=1e-7)  # the array format is exact, the PNG one is quantised


def test_videos_per_frame_and_whole(server):
    video = torch.rand(3, 3, 4, 8, 8, generator=torch.Generator().manual_seed(1))  # (N, C, F, H, W)
    prompts, metas = ["a red car", "a blue car", "a green car"], [{}] * 3
    per_frame = RemoteReward(url=server.url, format="array")(video, prompts, metas)
    assert server.batches[-1] == 12  # every frame as an image, averaged per video
    frames = video.permute(0, 2, 1, 3, 4).reshape(12, 3, 8, 8)
    want = PromptColor()(frames, [p for p in prompts for _ in range(4)], [{}] * 12).view(3, 4).mean(1)
    assert torch.allclose(per_frame, want, atol=1e-6)
    whole = Server(
        lambda imgs, p, m: [float(v.shape[1]) for v in imgs]
    )  # frames per video, as the server saw it
    try:
        got = RemoteReward(url=whole.url, video_native=True)(video, prompts, metas)
        assert got.tolist() == [4.0, 4.0, 4.0]
    finally:
        whole.stop()


def test_configured_as_a_component_and_weighted(server):
    reward = build_reward(
        RewardConfig(
            components=[
                {"name": "remote", "weight": 2.0, "args": {"url": server.url, "format": "array"}},
                {"name": "prompt_color", "weight": 0.0},
            ]
        )
    )
    pixels, prompts, metas = batch()
    total, parts = reward(pixels, prompts, metas)
    assert torch.allclose(parts["remote"], parts["prompt_color"], atol=1e-6)
    assert torch.allclose(total, 2 * parts["remote"])


def test_two_servers_as_labelled_components(server):
    """``remote:<label>`` lists one reward kind twice: each component its own server, logged by its name."""
    other = Server(lambda imgs, p, m: [float(i) for i in range(len(imgs))])
    try:
        reward = build_reward(
            RewardConfig(
                combine="per_reward_advantage",
                components=[
                    {"name": "remote:colour", "args": {"url": server.url, "format": "array"}},
                    {"name": "remote:index", "weight": 0.5, "args": {"url": other.url}},
                ],
            )
        )
        pixels, prompts, metas = batch()
        total, parts = reward(pixels, prompts, metas)
        assert set(parts) == {"remote:colour", "remote:index"}
        assert parts["remote:index"].tolist() == [0, 1, 2, 3, 4, 5]
        assert torch.allclose(total, parts["remote:colour"] + 0.5 * parts["remote:index"])
    finally:
        other.stop()


def one_line(err: Exception, *needles: str):
    msg = str(err)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_server_down_is_one_line_after_the_retries():
    with nothing_listens() as url, pytest.raises(RemoteRewardError) as exc:
        RemoteReward(url=url, retries=2, backoff=0.01)(*batch())
    one_line(exc.value, f"reward 'remote' at {url}", "no server answers", "after 3 tries")


def test_timeout_is_one_line():
    httpd, url, count = raw_server(lambda n: (time.sleep(1.0), (200, b'{"scores": []}'))[1])
    try:
        with pytest.raises(RemoteRewardError) as exc:
            RemoteReward(url=url, timeout=0.2, retries=1, backoff=0.01)(*batch())
        one_line(exc.value, "no answer within 0.2 s", "after 2 tries")
        assert count["n"] == 2
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    "status, body, needle",
    [
        (200, b"<html>oops</html>", "the answer is not JSON (starts '<html>oops</html>')"),
        (200, b'{"score": [1, 2]}', 'the answer has no "scores" list'),
        (200, b'{"scores": [1.0, 2.0]}', "answered 2 scores for 6 samples"),
        (200, b'{"scores": [1, 2, 3, 4, 5, "x"]}', "score 5 is not a number ('x')"),
        (200, b'{"scores": [1, 2, 3, 4, 5, 6], "info": [{}]}', '"info" must be a list of 6 objects'),
        (404, b"no such route", "HTTP 404 Not Found: no such route"),
    ],
)
def test_garbage_answers_are_one_line_never_a_score(status, body, needle):
    httpd, url, count = raw_server(lambda n: (status, body))
    try:
        with pytest.raises(RemoteRewardError) as exc:
            RemoteReward(url=url, retries=3, backoff=0.01)(*batch())
        one_line(exc.value, needle)
        assert count["n"] == 1  # an unusable answer is not retried: it would come back the same
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_retry_rides_out_a_server_error_then_scores():
    good = json.dumps({"scores": [0.5] * 6, "info": [{"k": i} for i in range(6)]}).encode()
    httpd, url, count = raw_server(lambda n: (503, b"warming up") if n <= 2 else (200, good))
    try:
        r = RemoteReward(url=url, retries=2, backoff=0.01)
        assert r(*batch()).tolist() == [0.5] * 6 and count["n"] == 3
        assert r.last_info == [{"k": i} for i in range(6)]
        with pytest.raises(RemoteRewardError) as exc:  # the same failures with one retry too few
            httpd2, url2, _ = raw_server(lambda n: (503, b"warming up") if n <= 2 else (200, good))
            try:
                RemoteReward(url=url2, retries=1, backoff=0.01)(*batch())
            finally:
                httpd2.shutdown()
                httpd2.server_close()
        one_line(exc.value, "HTTP 503", "warming up", "after 2 tries")
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    "args, needle",
    [
        ({}, "url: reward 'remote': an http:// or https:// address"),
        ({"url": "ftp://x"}, "url: reward 'remote'"),
        ({"url": "http://x", "timeout": 0}, "timeout: reward 'remote': must be a positive number"),
        ({"url": "http://x", "retries": -1}, "retries: reward 'remote': must be a non-negative integer"),
        ({"url": "http://x", "batch_size": 0}, "batch_size: reward 'remote': must be a positive integer"),
        ({"url": "http://x", "format": "jpeg"}, "format: reward 'remote': must be png or array"),
    ],
)
def test_bad_args_name_the_field(args, needle):
    with pytest.raises(UserError) as exc:
        build_reward(RewardConfig(components=[{"name": "remote", "args": args}]))
    one_line(exc.value, "reward.components.0.args." + needle)


def test_a_server_down_at_start_stops_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from tests.helpers import cli

    with nothing_listens() as url:
        code, _, err = cli(
            monkeypatch,
            capsys,
            "train",
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            "placement.mode=local",
            *as_sets(TINY_IMAGE),
            "--set",
            f"reward.components=[{{name: remote, args: {{url: '{url}', retries: 0}}}}]",
        )
    assert code == 2 and "reward.components.0: reward 'remote' failed in its dry run" in err, err
    assert "no server answers" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_server_stopping_mid_run_trains_no_unit_on_missing_scores(tmp_path):
    """The server answers the dry run, iteration 0's four units and two units of iteration 1, then
    stops: the run ends with the one-line error, one optimizer step taken, one iteration logged."""
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer
    from digenrl.run.rundir import read_metrics

    state = {"served": 0}

    def limited(images, prompts, metadata):
        state["served"] += 1
        if state["served"] == 7:  # the 7th call: the server goes away before answering
            threading.Thread(target=srv.stop).start()
            time.sleep(0.5)
        return numpy_prompt_color(images, prompts, metadata)

    srv = Server(limited)
    cfg = load_config(
        None,
        [
            "placement.mode=local",
            *TINY_IMAGE,
            "train.iterations=3",
            f"output.run_dir={tmp_path / 'run'}",
            "reward.components=[{name: remote, args: "
            f"{{url: '{srv.url}', retries: 1, backoff: 0.01, timeout: 5}}}}]",
        ],
    )
    trainer = LocalTrainer(cfg)
    with pytest.raises(RemoteRewardError) as exc:
        trainer.run()
    one_line(exc.value, f"reward 'remote' at {srv.url}")
    assert trainer.policy.version == 1  # iteration 0 trained; iteration 1 never reached its optimizer step
    rows = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0]


@pytest.mark.slow  # starts Ray
def test_inside_the_reward_actor(ray_cluster, server):
    """The reward actor (reward.service) builds the remote reward from the registry: same scores, same
    error."""
    import ray

    from digenrl.rewards.service import RewardClient, start_reward_actor

    cfg = RewardConfig(
        components=[{"name": "remote", "args": {"url": server.url, "format": "array"}}],
        service={"num_cpus": 0.1},
    )
    actor = start_reward_actor(cfg)
    try:
        pixels, prompts, metas = batch()
        total, parts = RewardClient(actor)(pixels, prompts, metas)
        assert torch.allclose(parts["remote"], PromptColor()(pixels, prompts, metas), atol=1e-6)
        server.stop()
        with pytest.raises(RemoteRewardError) as exc:
            RewardClient(actor)(pixels, prompts, metas)
        one_line(exc.value, "no server answers")
    finally:
        ray.kill(actor)
