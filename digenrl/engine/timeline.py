"""The run's timeline: every unit each worker ran with its wall-clock (or virtual) span, filled by the
Ray runtime and the planner's simulator alike; written as ``timeline.json`` (Chrome trace) and
``timeline.png``, and measured per iteration (``samples_per_s``, ``bubble_fraction``, over devices:
a follower of a multi-device worker is busy while its lead is). The contract: docs/architecture.md,
"The run directory"."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from digenrl.engine.timeline_draw import draw_timeline

KINDS = ("start", "rollout", "train", "step", "sync", "reward")  # start: a worker starting up
#: pool of helper rows (the reward actor): shown, not counted in the bubble
SERVICE_POOL = "service"


@dataclass(frozen=True)
class Event:
    worker: str
    pool: str
    kind: str  # one of KINDS
    uid: str
    iteration: int
    version: int  # policy version the unit ran with (for sync: the version shipped)
    start: float  # seconds since run start
    end: float
    sample_versions: tuple[int, ...] = ()  # train units: versions of the samples trained
    args: dict = field(default_factory=dict, hash=False, compare=False)  # extra: samples, bytes, ...

    @property
    def duration(self) -> float:
        return self.end - self.start


class Timeline:
    def __init__(self) -> None:
        self.workers: dict[str, str] = {}  # worker -> pool, in registration order (rows)
        self.follows: dict[str, str] = {}  # follower device -> the lead that runs its calls
        self.events: list[Event] = []

    # -- recording -----------------------------------------------------------------------

    def add_worker(self, name: str, pool: str, follows: str | None = None) -> None:
        """Register a worker, so that it counts in the bubble even if it never gets work;
        ``follows``: the lead of the multi-device worker this device belongs to."""
        self.workers.setdefault(name, pool)
        if follows is not None and follows != name:
            self.follows[name] = follows

    def add(self, event: Event) -> Event:
        if event.kind not in KINDS:
            raise ValueError(f"event kind must be one of {KINDS}, got {event.kind!r}")
        if event.end < event.start:
            raise ValueError(f"event {event.uid!r} ends before it starts")
        self.add_worker(event.worker, event.pool)
        self.events.append(event)
        return event

    def record(
        self,
        worker: str,
        kind: str,
        uid: str,
        iteration: int,
        version: int,
        start: float,
        end: float,
        sample_versions=(),
        **args,
    ) -> Event:
        return self.add(
            Event(
                worker,
                self.workers.get(worker, "default"),
                kind,
                uid,
                iteration,
                version,
                start,
                end,
                tuple(sample_versions),
                args,
            )
        )

    # -- analysis ------------------------------------------------------------------------

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def iteration_spans(self) -> dict[int, tuple[float, float]]:
        """Iteration -> (start, end): from the previous step's end to this one's end. An
        iteration without step events (a partial run) ends at its last event."""
        step_end: dict[int, float] = {}
        last_end: dict[int, float] = {}
        for e in self.events:
            if e.kind in ("sync", "start"):  # a fetch is booked to the unit it precedes; start-up precedes
                continue  # the first iteration: neither defines a span
            last_end[e.iteration] = max(last_end.get(e.iteration, e.end), e.end)
            if e.kind == "step":
                step_end[e.iteration] = max(step_end.get(e.iteration, e.end), e.end)
        spans, start = {}, min((e.start for e in self.events if e.kind != "start"), default=0.0)
        for k in sorted(last_end):
            end = max(step_end.get(k, last_end[k]), start)
            spans[k] = (start, end)
            start = end
        return spans

    def lead_of(self, worker: str) -> str:
        """The scheduled worker whose units ``worker`` computes (itself unless it follows one)."""
        seen = {worker}
        while worker in self.follows and self.follows[worker] not in seen:
            worker = self.follows[worker]
            seen.add(worker)
        return worker

    def groups(self) -> dict[str, list[str]]:
        """Lead -> its devices (the lead first, then its followers), in registration order."""
        out: dict[str, list[str]] = {}
        for w in self.workers:
            out.setdefault(self.lead_of(w), []).append(w)
        return {lead: sorted(devices, key=lambda d: d != lead) for lead, devices in out.items()}

    def busy(self, worker: str, start: float, end: float) -> float:
        """Seconds of [start, end] in which device ``worker`` ran something: the union of its
        events and, for a follower, its lead's."""
        mine = {worker, self.lead_of(worker)}
        intervals = sorted(
            (max(e.start, start), min(e.end, end))
            for e in self.events
            if e.worker in mine and e.end > start and e.start < end
        )
        total, cur_s, cur_e = 0.0, None, None
        for s, e in intervals:
            if e <= s:
                continue
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total

    def bubble_fraction(self, start: float, end: float) -> float:
        devices = [w for w, pool in self.workers.items() if pool != SERVICE_POOL]
        width = (end - start) * len(devices)
        if width <= 0:
            return 0.0
        return 1.0 - sum(self.busy(w, start, end) for w in devices) / width

    def iteration_stats(self, only: int | None = None) -> list[dict]:
        """Per iteration (or just iteration ``only``): span, samples rolled out, samples_per_s,
        bubble_fraction, device-seconds of rollout / train (+ step) work, and weight-sync
        seconds and bytes."""
        spans = self.iteration_spans()
        if only is not None:
            spans = {only: spans[only]}
        mine: dict[int, list[Event]] = {k: [] for k in spans}
        for e in self.events:
            if e.iteration in mine:
                mine[e.iteration].append(e)
        rows = []
        for k, (start, end) in spans.items():
            events, wall = mine[k], end - start
            samples = sum(e.args.get("samples", 0) for e in events if e.kind == "rollout")
            rows.append(
                {
                    "iteration": k,
                    "start": start,
                    "end": end,
                    "wall_s": wall,
                    "samples": samples,
                    "samples_per_s": samples / wall if wall > 0 else 0.0,
                    "bubble_fraction": self.bubble_fraction(start, end),
                    "rollout_device_s": sum(e.duration for e in events if e.kind == "rollout"),
                    "train_device_s": sum(e.duration for e in events if e.kind in ("train", "step")),
                    "sync_s": sum(e.duration for e in events if e.kind == "sync"),
                    "sync_bytes": sum(e.args.get("bytes", 0) for e in events if e.kind == "sync"),
                }
            )
        return rows

    def summary(self, skip: int = 0, tail: int = 0) -> dict:
        """Throughput and bubble over the steady state: without the first ``skip`` iterations
        (start-up) and the last ``tail`` (with one-step async the last one has no next rollout
        to overlap)."""
        rows = self.iteration_stats()
        rows = rows[skip : len(rows) - tail]
        if not rows:
            return {"samples_per_s": 0.0, "bubble_fraction": 0.0, "wall_s": 0.0, "samples": 0}
        start, end = rows[0]["start"], rows[-1]["end"]
        samples = sum(r["samples"] for r in rows)
        n = len(rows)
        return {
            "iterations": n,
            "wall_s": end - start,
            "samples": samples,
            "samples_per_s": samples / (end - start) if end > start else 0.0,
            "bubble_fraction": self.bubble_fraction(start, end),
            "iteration_s": (end - start) / n,
            "rollout_device_s": sum(r["rollout_device_s"] for r in rows) / n,
            "train_device_s": sum(r["train_device_s"] for r in rows) / n,
            "sync_s": sum(r["sync_s"] for r in rows) / n,
            "sync_bytes": sum(r["sync_bytes"] for r in rows) / n,
        }

    # -- Chrome trace --------------------------------------------------------------------

    def to_chrome_trace(self) -> dict:
        pools = list(dict.fromkeys(self.workers.values()))
        pid = {p: i + 1 for i, p in enumerate(pools)}
        tid = {w: i + 1 for i, w in enumerate(self.workers)}
        trace = []
        for p in pools:
            trace.append({"ph": "M", "name": "process_name", "pid": pid[p], "tid": 0, "args": {"name": p}})
        for w, p in self.workers.items():
            meta = {"name": w, "follows": self.follows[w]} if w in self.follows else {"name": w}
            trace.append({"ph": "M", "name": "thread_name", "pid": pid[p], "tid": tid[w], "args": meta})
        for e in sorted(self.events, key=lambda e: e.start):
            args = {"kind": e.kind, "unit": e.uid, "iteration": e.iteration, "version": e.version}
            if e.kind == "train":
                args["sample_versions"] = list(e.sample_versions)
            args.update(e.args)
            trace.append(
                {
                    "name": f"{e.kind} {e.uid} v{e.version}",
                    "cat": e.kind,
                    "ph": "X",
                    "ts": e.start * 1e6,
                    "dur": e.duration * 1e6,
                    "pid": pid[e.pool],
                    "tid": tid[e.worker],
                    "args": args,
                }
            )
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def save_json(self, path: Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome_trace(), default=_jsonable))
        return path

    @classmethod
    def from_chrome_trace(cls, trace: dict | str | Path) -> Timeline:
        """Rebuild a timeline from ``timeline.json`` (or its parsed content)."""
        if not isinstance(trace, dict):
            trace = json.loads(Path(trace).read_text())
        names, follows = {}, {}
        for ev in trace["traceEvents"]:
            if ev["ph"] == "M":
                names[(ev["name"], ev["pid"], ev["tid"] if ev["name"] == "thread_name" else 0)] = ev["args"][
                    "name"
                ]
                if "follows" in ev["args"]:
                    follows[ev["args"]["name"]] = ev["args"]["follows"]
        tl = cls()
        for (kind, pid, tid), name in names.items():
            if kind == "thread_name":
                tl.add_worker(name, names[("process_name", pid, 0)], follows.get(name))
        for ev in trace["traceEvents"]:
            if ev["ph"] != "X":
                continue
            args = dict(ev["args"])
            kind, uid = args.pop("kind"), args.pop("unit")
            iteration, version = args.pop("iteration"), args.pop("version")
            sample_versions = tuple(args.pop("sample_versions", ()))
            worker = names[("thread_name", ev["pid"], ev["tid"])]
            start = ev["ts"] / 1e6
            tl.add(
                Event(
                    worker,
                    tl.workers[worker],
                    kind,
                    uid,
                    iteration,
                    version,
                    start,
                    start + ev["dur"] / 1e6,
                    sample_versions,
                    args,
                )
            )
        return tl

    def after_earlier(self, path: Path, from_iteration: int) -> Timeline:
        """A resumed run's timeline as part of the whole run: the earlier ``timeline.json`` at ``path``
        (its events of iterations before ``from_iteration``, the checkpoint's: later ones were run
        again) followed by this run's events, shifted to start where the earlier ones end. Every
        invariant of a run (each unit once, steps per iteration, spans that tile) then holds over
        the whole run. Without a readable earlier file: this timeline unchanged."""
        try:
            earlier = Timeline.from_chrome_trace(path)
        except (OSError, ValueError, KeyError, TypeError):
            return self
        out = Timeline()
        for name, pool in [*earlier.workers.items(), *self.workers.items()]:
            out.add_worker(name, pool, earlier.follows.get(name) or self.follows.get(name))
        kept = [e for e in earlier.events if e.iteration < from_iteration or e.kind == "start"]
        offset = max((e.end for e in kept), default=0.0)
        for e in kept:
            out.add(e)
        for e in self.events:
            out.add(dataclasses.replace(e, start=e.start + offset, end=e.end + offset))
        return out

    # -- Gantt chart ---------------------------------------------------------------------

    def to_png(self, path: Path, width: int = 1400, window: int = 3) -> Path:
        """``timeline.png``: a whole-run utilisation strip per worker above the last ``window``
        iterations at full detail (see :mod:`digenrl.engine.timeline_draw`)."""

        return draw_timeline(self, path, width=width, window=window)


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
