"""GenEval's rule on hand-made detections for every GenEval tag, and the ``geneval`` reward through a
detector service on 127.0.0.1 with GenEval metadata rows read from a ``*_metadata.jsonl``."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from digenrl.config.train import PromptsConfig, RewardConfig
from digenrl.data.prompts import load_prompts
from digenrl.errors import UserError
from digenrl.rewards import build_reward
from digenrl.rewards.geneval import geneval_correct, kept_objects, relations, score_detections


def obj(x0, y0, x1, y1, score=0.95, color=None):
    return {"box": [x0, y0, x1, y1], "score": score, "color": color}


# GenEval's six tags, metadata rows as its evaluation_metadata.jsonl writes them
SINGLE = {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"}
TWO = {
    "tag": "two_object",
    "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}],
    "prompt": "a photo of a dog and a cat",
}
COUNTING = {
    "tag": "counting",
    "include": [{"class": "cat", "count": 3}],
    "exclude": [{"class": "cat", "count": 4}],
    "prompt": "a photo of three cats",
}
COLORS = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a red car"}
POSITION = {
    "tag": "position",
    "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
    "prompt": "a photo of a cat left of a dog",
}
COLOR_ATTR = {
    "tag": "color_attr",
    "include": [
        {"class": "car", "count": 1, "color": "red"},
        {"class": "bench", "count": 1, "color": "blue"},
    ],
    "prompt": "a photo of a red car and a blue bench",
}


def verdict(dets, meta):
    return geneval_correct(kept_objects(dets, meta["tag"]), meta)[0]


def test_relations_by_hand():
    # A's centre 50 px left of B's, extents 10 + 10: x shrinks to 50 - 0.1 * 20 = 48, 48 / 50 > 0.5
    assert relations([0, 0, 10, 10], [50, 0, 60, 10]) == {"left of"}
    assert relations([50, 0, 60, 10], [0, 0, 10, 10]) == {"right of"}
    assert relations([0, 0, 10, 10], [0, 40, 10, 50]) == {"above"}  # y grows downwards
    # diagonal: (-20, -20) shrinks to (-18, -18), / 28.28 = -0.64 on both axes
    assert relations([0, 0, 10, 10], [20, 20, 30, 30]) == {"left of", "above"}
    assert relations([0, 0, 10, 10], [1, 0, 11, 10]) == set()  # an offset within the boxes' margin
    # a wide B: the margin 0.1 * (10 + 200) = 21 eats all of a 20-px offset
    assert relations([0, 0, 10, 10], [-75, 0, 125, 10]) == set()


def test_single_and_two_objects():
    assert verdict({"dog": [obj(0, 0, 9, 9)]}, SINGLE)
    assert not verdict({}, SINGLE)
    assert not verdict({"dog": [obj(0, 0, 9, 9, score=0.2)]}, SINGLE)  # below the 0.3 threshold
    assert verdict({"dog": [obj(0, 0, 9, 9, score=0.31)], "cat": [obj(0, 0, 5, 5)]}, TWO)
    assert not verdict({"dog": [obj(0, 0, 9, 9)]}, TWO)  # co-occurrence: both or nothing


def test_counting_uses_the_high_threshold_and_the_exclude_clause():
    three = [obj(i * 10, 0, i * 10 + 8, 8) for i in range(3)]
    assert verdict({"cat": three}, COUNTING)
    assert not verdict({"cat": three[:2]}, COUNTING)  # too few
    assert not verdict({"cat": three + [obj(40, 0, 48, 8)]}, COUNTING)  # four: the exclude clause
    # a 4th at 0.85 is below counting's 0.9: not counted; a 3rd at 0.85 leaves two
    assert verdict({"cat": three + [obj(40, 0, 48, 8, score=0.85)]}, COUNTING)
    assert not verdict({"cat": three[:2] + [obj(40, 0, 48, 8, score=0.85)]}, COUNTING)


def test_colors_and_color_attr_judge_the_most_confident_objects():
    assert verdict({"car": [obj(0, 0, 9, 9, color="red")]}, COLORS)
    assert not verdict({"car": [obj(0, 0, 9, 9, color="blue")]}, COLORS)
    # the most confident car is the one judged: a red one behind a blue, more confident one fails
    cars = [obj(0, 0, 9, 9, 0.6, "red"), obj(0, 0, 9, 9, 0.9, "blue")]
    assert not verdict({"car": cars}, COLORS)
    good = {"car": [obj(0, 0, 9, 9, color="red")], "bench": [obj(20, 0, 29, 9, color="blue")]}
    assert verdict(good, COLOR_ATTR)
    swapped = {"car": [obj(0, 0, 9, 9, color="blue")], "bench": [obj(20, 0, 29, 9, color="red")]}
    assert not verdict(swapped, COLOR_ATTR)


def test_position_is_relative_to_the_matched_target():
    dog, cat_left, cat_right = obj(50, 0, 60, 10), obj(0, 0, 10, 10), obj(100, 0, 110, 10)
    assert verdict({"dog": [dog], "cat": [cat_left]}, POSITION)
    assert not verdict({"dog": [dog], "cat": [cat_right]}, POSITION)
    ok, why = geneval_correct(kept_objects({"cat": [cat_left]}, "position"), POSITION)
    assert not ok and "no target for cat" in why and "expected dog>=1" in why
    # the batch form: 1 / 0 per sample
    dets = [{"dog": [dog], "cat": [cat_left]}, {"dog": [dog], "cat": [cat_right]}]
    assert score_detections(dets, [POSITION, POSITION]).tolist() == [1.0, 0.0]


class Detector(BaseHTTPRequestHandler):
    """A detector service: answers the detections queued in ``server.answers`` and keeps the request."""

    def do_POST(self):
        self.server.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        body = json.dumps(self.server.answers.pop(0)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def detector():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Detector)
    server.requests, server.answers = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_geneval_through_a_detector_service_on_metadata_jsonl(detector, tmp_path):
    file = tmp_path / "test_metadata.jsonl"
    file.write_text("\n".join(json.dumps(row) for row in (POSITION, COUNTING)) + "\n")
    prompts = load_prompts(PromptsConfig(file=file))
    assert [p.meta["tag"] for p in prompts] == ["position", "counting"] and "prompt" not in prompts[0].meta
    url = f"http://127.0.0.1:{detector.server_port}/detect"
    reward = build_reward(RewardConfig(components=[{"name": "geneval", "args": {"url": url, "retries": 0}}]))
    three = [obj(i * 10, 0, i * 10 + 8, 8) for i in range(3)]
    detector.answers.append(
        {"detections": [{"dog": [obj(50, 0, 60, 10)], "cat": [obj(0, 0, 10, 10)]}, {"cat": three[:2]}]}
    )
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    _, parts = reward(images, [p.text for p in prompts], [p.meta for p in prompts])
    assert parts["geneval"].tolist() == [1.0, 0.0]
    sent = detector.requests[-1]
    assert sent["metadata"][1]["tag"] == "counting" and len(sent["images"]) == 2  # base64 PNGs
    # a malformed answer is one line naming the reward and the URL
    detector.answers.append({"detections": [{"cat": [{"box": [0, 0, 1]}]}, {}]})
    with pytest.raises(UserError, match=r"^reward 'geneval' at http://127\.0\.0\.1:\d+/detect: a detection"):
        reward(images, [p.text for p in prompts], [p.meta for p in prompts])
    with pytest.raises(UserError, match="has no GenEval metadata"):
        reward(images, ["a dog", "a cat"], [{}, {}])


def test_flow_grpo_partial_score_by_hand():
    from digenrl.rewards.geneval import flow_grpo_score

    def score(dets, meta):
        return flow_grpo_score(kept_objects(dets, meta["tag"]), meta)

    cats = [obj(i * 10, 0, i * 10 + 8, 8) for i in range(4)]
    assert score({"cat": cats[:3]}, COUNTING) == 1.0
    assert score({"cat": cats[:2]}, COUNTING) == pytest.approx(1 - 1 / 3)  # 2 of 3
    assert score({"cat": cats}, COUNTING) == pytest.approx(1 - 1 / 3)  # 4 of 3: exclude is not scored
    # colour: car [count 1, colour 1], bench [count 1, colour 0] -> 3 / 4
    half = {"car": [obj(0, 0, 9, 9, color="red")], "bench": [obj(20, 0, 29, 9, color="green")]}
    assert score(half, COLOR_ATTR) == pytest.approx(3 / 4)
    assert score({"car": [obj(0, 0, 9, 9, color="red")]}, COLOR_ATTR) == pytest.approx(
        2 / 4
    )  # no bench: 0, 0
    # position: dog [1], cat [1, relation]; a failed relation adds 0 then 1 (as their server does)
    dog, left, right = obj(50, 0, 60, 10), obj(0, 0, 10, 10), obj(100, 0, 110, 10)
    assert score({"dog": [dog], "cat": [left]}, POSITION) == 1.0
    assert score({"dog": [dog], "cat": [right]}, POSITION) == pytest.approx(3 / 4)
    assert score({"cat": [left]}, POSITION) == pytest.approx(1 / 3)  # dog 0; cat 1; no target 0


def test_the_reward_scores_flow_grpo_when_asked(detector):
    url = f"http://127.0.0.1:{detector.server_port}/detect"
    args = {"url": url, "retries": 0, "score": "flow_grpo"}
    reward = build_reward(RewardConfig(components=[{"name": "geneval", "args": args}]))
    detector.answers.append({"detections": [{"cat": [obj(i * 10, 0, i * 10 + 8, 8) for i in range(2)]}]})
    meta = {k: v for k, v in COUNTING.items() if k != "prompt"}
    assert reward(torch.rand(1, 3, 8, 8), ["three cats"], [meta])[1]["geneval"].tolist() == pytest.approx(
        [2 / 3]
    )
    with pytest.raises(UserError, match=r"args\.score: .*must be correct or flow_grpo"):
        build_reward(RewardConfig(components=[{"name": "geneval", "args": {"url": url, "score": "x"}}]))
