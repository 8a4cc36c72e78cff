"""``geneval``: GenEval's correctness rule (Ghosh et al. 2023, ``evaluation/evaluate_images.py``) on the
detections of a remote detector service, against the prompt's GenEval metadata row.

Details: docs/modules.md, `digenrl.rewards.geneval`.
"""

from __future__ import annotations

import json
import math

import torch

from digenrl.errors import UserError
from digenrl.rewards.base import RewardArgError, register
from digenrl.rewards.remote import RemoteReward, _positive, encode_images

RELATIONS = ("left of", "right of", "above", "below")


def relations(box_a, box_b, threshold: float = 0.1) -> set[str]:
    """Where box A is relative to box B (boxes ``[x0, y0, x1, y1]``, y down): the centre offset, each
    axis shrunk by ``threshold`` x the two boxes' summed extent on it, then normalised by the offset's
    length; a component beyond 0.5 names a relation (GenEval's ``relative_position``)."""
    (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = box_a[:4], box_b[:4]
    off = ((ax0 + ax1 - bx0 - bx1) / 2, (ay0 + ay1 - by0 - by1) / 2)
    dims = ((ax1 - ax0) + (bx1 - bx0), (ay1 - ay0) + (by1 - by0))
    shrunk = [math.copysign(max(abs(o) - threshold * abs(d), 0.0), o) for o, d in zip(off, dims)]
    if all(abs(s) < 1e-3 for s in shrunk):
        return set()
    dx, dy = (s / math.hypot(*off) for s in shrunk)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def kept_objects(detections: dict, tag: str, threshold=0.3, counting_threshold=0.9, max_objects=16) -> dict:
    """Per class, the detections GenEval keeps: above the confidence threshold, most confident first."""
    floor = counting_threshold if tag == "counting" else threshold
    kept = {}
    for cls, objs in detections.items():
        objs = sorted((o for o in objs if o["score"] > floor), key=lambda o: -o["score"])[:max_objects]
        if objs:
            kept[cls] = objs
    return kept


def geneval_correct(objects: dict, meta: dict, position_threshold: float = 0.1) -> tuple[bool, str]:
    """GenEval's verdict on the kept ``objects`` for a metadata row, and why not (one reason a line)."""
    reasons, matched = [], []  # matched[j]: the objects include clause j matched, or None
    for req in meta.get("include", []):
        cls, n = req["class"], req["count"]
        found = objects.get(cls, [])[:n]
        ok = len(found) >= n
        if not ok:
            reasons.append(f"expected {cls}>={n}, found {len(found)}")
        elif "color" in req and sum(o.get("color") == req["color"] for o in found) < n:
            ok = False
            reasons.append(
                f"expected {req['color']} {cls}>={n}, found colours {[o.get('color') for o in found]}"
            )
        if ok and "position" in req:
            rel, j = req["position"]
            if matched[j] is None:
                ok = False
                reasons.append(f"no target for {cls} to be {rel}")
            elif not all(
                rel in relations(o["box"], t["box"], position_threshold) for o in found for t in matched[j]
            ):
                ok = False
                reasons.append(f"expected {cls} {rel} target")
        matched.append(found if ok else None)
    for req in meta.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            reasons.append(f"expected {req['class']}<{req['count']}, found {len(objects[req['class']])}")
    return not reasons, "\n".join(reasons)


def _fraction(want: int, got: int) -> float:
    return 1 - abs(want - got) / want


def flow_grpo_score(objects: dict, meta: dict, position_threshold: float = 0.1) -> float:
    """Flow-GRPO's GenEval training score (its reward server's ``evaluate_reward``): the mean of one
    term per check of each ``include`` clause, ``exclude`` ignored. Count: 1 - |count - found| / count
    (every kept object of the class); when the count is not exact, a colour or position check scores
    0. Colour: 1 - |count - found in that colour| / count; an inexact colour skips the position check.
    Position: 1 when every object stands so to every matched target object; on the first pair that
    does not, 0 and then 1 (their server appends both: kept, to score as they train)."""
    terms, matched = [], []
    for req in meta.get("include", []):
        n, found = req["count"], objects.get(req["class"], [])
        terms.append(_fraction(n, len(found)))
        ok = len(found) == n
        if not ok and ("color" in req or "position" in req):
            terms.append(0.0)
        if ok and "color" in req:
            hits = sum(o.get("color") == req["color"] for o in found)
            terms.append(_fraction(n, hits))
            ok = hits == n
        if ok and req.get("position") is not None:
            rel, j = req["position"]
            if matched[int(j)] is None:
                ok = False
                terms.append(0.0)
            else:
                pairs = (
                    rel in relations(o["box"], t["box"], position_threshold)
                    for o in found
                    for t in matched[int(j)]
                )
                if not all(pairs):
                    ok = False
                    terms.append(0.0)
                terms.append(1.0)
        matched.append(found if ok else None)
    return sum(terms) / len(terms) if terms else 0.0


class Rules:
    """GenEval's scoring arguments, checked (a bad one is a :class:`RewardArgError`), and the verdict
    on one sample's detections: ``score`` ``correct`` (GenEval's 1 / 0) or ``flow_grpo``."""

    def __init__(
        self, threshold=0.3, counting_threshold=0.9, max_objects=16, position_threshold=0.1, score="correct"
    ):
        if score not in ("correct", "flow_grpo"):
            raise RewardArgError("score", f"must be correct or flow_grpo (got {score!r})")
        self.score_kind = score
        self.threshold = _positive("threshold", threshold, allow_zero=True)
        self.counting_threshold = _positive("counting_threshold", counting_threshold, allow_zero=True)
        self.max_objects = _positive("max_objects", max_objects, int)
        self.position_threshold = _positive("position_threshold", position_threshold, allow_zero=True)

    def judge(self, detections: dict, meta: dict) -> tuple[float, dict]:
        """(score, {"tag", "reason"}) of one sample's detections against its metadata row."""
        objs = kept_objects(
            detections, meta["tag"], self.threshold, self.counting_threshold, self.max_objects
        )
        ok, why = geneval_correct(objs, meta, self.position_threshold)
        if self.score_kind == "flow_grpo":
            score = flow_grpo_score(objs, meta, self.position_threshold)
        else:
            score = float(ok)
        return score, {"tag": meta["tag"], "reason": why}


def check_meta(meta: dict, prompt: str, reward: str = "geneval") -> None:
    if "tag" not in meta or not isinstance(meta.get("include"), list):
        raise UserError(
            f"reward {reward}: prompt {prompt!r} has no GenEval metadata (a prompts.file .jsonl row with "
            '"tag" and "include", as GenEval\'s evaluation_metadata.jsonl)'
        )


@register("geneval")
class GenevalReward(RemoteReward):
    """GenEval correctness from a detector service: ``args`` as ``remote`` (``url`` the detector's)
    plus ``threshold`` (0.3), ``counting_threshold`` (0.9), ``max_objects`` (16), ``position_threshold``
    (0.1), GenEval's defaults, and ``score``: ``correct`` (GenEval's 1 / 0) or ``flow_grpo`` (Flow-GRPO's
    partial training score, :func:`flow_grpo_score`). The service answers
    ``{"detections": [one {class: [object]} per sample]}``.
    """

    def __init__(
        self,
        url: str | None = None,
        threshold: float = 0.3,
        counting_threshold: float = 0.9,
        max_objects: int = 16,
        position_threshold: float = 0.1,
        score: str = "correct",
        **remote,
    ):
        super().__init__(url=url, **remote)
        self.rules = Rules(threshold, counting_threshold, max_objects, position_threshold, score)

    def _score_batch(self, images, prompts, metadata):
        for p, m in zip(prompts, metadata):
            check_meta(m, p)
        payload = {
            "format": self.format,
            "prompts": list(prompts),
            "metadata": [dict(m) for m in metadata],
            "images": encode_images(images, self.format),
        }
        detections = self._detections(self._post_with_retries(json.dumps(payload).encode()), len(prompts))
        judged = [self.rules.judge(det, meta) for det, meta in zip(detections, metadata)]
        return [s for s, _ in judged], [i for _, i in judged]

    def _detections(self, data: bytes, n: int) -> list[dict]:
        try:
            dets = json.loads(data).get("detections")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            dets = None
        if not (isinstance(dets, list) and len(dets) == n and all(isinstance(d, dict) for d in dets)):
            raise self._error(f'the answer must be {{"detections": [{n} objects, one per sample]}}')
        try:
            for d in dets:
                for objs in d.values():
                    for o in objs:
                        if len(o["box"]) != 4 or not isinstance(o["score"], (int, float)):
                            raise ValueError
        except (TypeError, KeyError, ValueError, AttributeError):
            raise self._error(
                'a detection must be {"box": [x0, y0, x1, y1], "score": s, "color"?: c}'
            ) from None
        return dets


def score_detections(detections: list[dict], metadata: list[dict], **kw) -> torch.Tensor:
    """GenEval correctness of a batch from detections already made (no service): 1 or 0 per sample."""
    pos = kw.pop("position_threshold", 0.1)
    return torch.tensor(
        [
            float(geneval_correct(kept_objects(d, m["tag"], **kw), m, pos)[0])
            for d, m in zip(detections, metadata)
        ]
    )
