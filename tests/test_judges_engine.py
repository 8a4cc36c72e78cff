"""``geneval`` and ``vlm_judge`` in one disaggregated engine run: both remote clients built and called on
the rollout workers (after each unit), against a detector service and an OpenAI chat-completions
server on 127.0.0.1, on prompts from a GenEval ``*_metadata.jsonl`` file. The run's per-reward means
equal what the servers answered."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import QUIET, TINY
from tests.test_vlm_judge import Chat

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROWS = [  # one GenEval row the detector below passes, one it fails
    {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"},
    {"tag": "counting", "include": [{"class": "cat", "count": 3}], "prompt": "a photo of three cats"},
]


class Detector(BaseHTTPRequestHandler):
    """Detects the row's first included class once per image: a single object passes, three cats fail."""

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(req)
        box = {"box": [0, 0, 8, 8], "score": 0.95}
        dets = [{m["include"][0]["class"]: [box]} for m in req["metadata"]]
        body = json.dumps({"detections": dets}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(handler):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.requests, srv.replies, srv.mode = [], [], "ok"
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.mark.slow
def test_geneval_and_a_vlm_judge_score_an_engine_run_on_the_rollout_workers(ray_cluster, tmp_path):
    from digenrl.config.run import load_config
    from digenrl.launch import run_engine
    from digenrl.rewards import scored_after_unit
    from digenrl.run.rundir import read_metrics

    detector, chat = serve(Detector), serve(Chat)
    meta = tmp_path / "train_metadata.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    geneval = f"{{name: geneval, weight: 1.0, args: {{url: 'http://127.0.0.1:{detector.server_port}/d'}}}}"
    judge = (
        f"{{name: vlm_judge, weight: 0.1, args: {{url: 'http://127.0.0.1:{chat.server_port}/v1/chat/completions',"
        " model: qwen-vl, concurrency: 4}}"
    )
    cfg = load_config(
        None,
        [
            *TINY,
            *QUIET,
            f"prompts.file={meta}",
            f"reward.components=[{geneval}, {judge}]",
            "train.iterations=2",
            "placement.mode=disaggregated",
            "engine.tag=false",
            "engine.tsp_degree=1",
            "engine.max_staleness=0",
        ],
    )
    assert scored_after_unit(cfg)  # remote clients: on the rollout workers, after the unit
    try:
        run_engine(cfg, run_dir=tmp_path / "run")
    finally:
        detector.shutdown(), chat.shutdown()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    samples = 2 * 2 * 4  # iterations x prompts x G
    scored = [m for req in detector.requests for m in req["metadata"]]
    assert [m["tag"] for m in scored].count("counting") >= samples // 2  # every sample (+ the dry run)
    for row in rows:  # per iteration: the dog row's 4 samples pass, the cats' 4 fail
        assert row["reward/geneval"] == pytest.approx(0.5)
        assert row["reward_mean"] == pytest.approx(row["reward/geneval"] + 0.1 * row["reward/vlm_judge"])
    # the judge's replies, as the server computed them (10 x the PNG's mean brightness), are the run's
    answered = [float(reply.rsplit("Score: ", 1)[1]) for reply in chat.replies]
    assert len(answered) >= samples
    run_mean = sum(row["reward/vlm_judge"] for row in rows) / 2
    assert run_mean == pytest.approx(sum(answered[-samples:]) / samples, abs=1e-3)
