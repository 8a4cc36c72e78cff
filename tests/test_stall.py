"""A stalled group member (``engine.stall_timeout_s``): a follower SIGSTOPped as its share of a unit
starts (``<uid>:start:stop``) neither raises nor answers, as a hung NCCL peer does not, so its lead
waits in the unit's first collective. The driver's pings find it within ``stall_timeout_s`` and take
its group down: an FSDP trainer pair restarts the run from its checkpoint, a sequence-parallel
rollout pair is restarted whole and its unit generated again once. Without the pings the lead waited
for ``engine.group_timeout_s`` (1800 s by default; 120 s here, so a regression fails, not hangs)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray = pytest.importorskip("ray")

from digenrl.config.run import load_config  # noqa: E402
from digenrl.engine.stall import StallWatch  # noqa: E402
from digenrl.engine.timeline import Timeline  # noqa: E402
from digenrl.launch import run_engine  # noqa: E402
from tests.helpers import QUIET, TINY, assert_timeline_invariants  # noqa: E402

STALL_S = 8
BASE = [
    *TINY,
    *QUIET,
    "train.iterations=2",
    "engine.tsp_degree=1",
    "engine.max_staleness=0",
    "placement.mode=disaggregated",
    f"engine.stall_timeout_s={STALL_S}",
    "engine.group_timeout_s=120",
]
CASES = {  # the follower stopped, its unit, the case's settings
    "trainer_fsdp_follower": (
        "trainer1",
        "train-1-0-0",
        [
            "engine.gap=true",
            "engine.tag=false",
            "train.fsdp=2",
            "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 2}]",
            "output.checkpoint_every=1",
            "engine.trainer_restarts=1",
        ],
    ),
    "rollout_sp_follower": (
        "rollout1",
        "rollout-0-1",
        [
            "engine.gap=false",
            "engine.tag=false",
            "engine.rollout_sp=2",
            "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]",
        ],
    ),
}


def stopped_at(worker: str, uid: str) -> tuple[int, float] | None:
    """(pid, time) of the process that SIGSTOPped itself as ``worker`` in ``uid``, from the line the
    fault plugin wrote to its Ray log (the suite's cluster forwards no actor output)."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    line = re.compile(rf"fault injection: {worker} stops in {re.escape(uid)}:start at ([0-9.]+)")
    for log in logs.glob("worker-*.err"):
        found = line.search(log.read_text(errors="replace"))
        if found:
            return int(log.stem.rsplit("-", 1)[1]), float(found.group(1))
    return None


def gone(pid: int, wait_s: float = 15.0) -> bool:
    """Whether process ``pid`` ended (or is a zombie) within ``wait_s`` (Ray kills a stopped one in ~5 s)."""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_stopped_follower_is_found_by_the_driver(ray_cluster, tmp_path, monkeypatch, capsys, case):
    worker, uid, sets = CASES[case]
    found = []  # when the driver declared the stall
    check = StallWatch.check

    def timed(self, busy):
        stalled = check(self, busy)
        if stalled:
            found.append(time.time())
        return stalled

    monkeypatch.setattr(StallWatch, "check", timed)
    cfg = load_config(None, BASE + sets + [f"engine.faults=[{{worker: {worker}, unit: '{uid}:start:stop'}}]"])
    stop = None
    try:
        result = run_engine(cfg, run_dir=tmp_path / "run")
        stop = stopped_at(worker, uid)
    finally:  # nothing is left stopped on the machine, whatever happened
        stop = stop or stopped_at(worker, uid)
        if stop is not None and not gone(stop[0]):
            os.kill(stop[0], signal.SIGKILL)
            pytest.fail(f"the stopped process {stop[0]} outlived the run")
    err = capsys.readouterr().err
    assert stop is not None and found, err
    print(f"{case}: the stall found {found[0] - stop[1]:.2f} s after the SIGSTOP")  # benchmarks/RESULTS.md
    assert re.search(
        rf"warning: {worker} gave no answer for \d+ s \(engine.stall_timeout_s: {STALL_S}\)", err
    )
    assert "(engine.group_timeout_s)" not in err  # found by the pings, not by the call's length
    assert [r["iteration"] for r in result.metrics] == [0, 1]
    tl = Timeline.from_chrome_trace(tmp_path / "run" / "timeline.json")
    assert_timeline_invariants(cfg, tl)  # every group generated once (as recorded) and trained once
    if worker.startswith("trainer"):  # the run restarted from its iteration-1 checkpoint
        assert f"while running {uid} (GroupStalled: {worker} gave no answer" in err
        assert "restarting every worker from" in err and "iter-000001" in err
    else:  # the pair restarted whole, its unit generated again once
        assert result.metrics[-1]["worker_restarts"] >= 1
        assert Counter(r.uid for r in tl.of("rollout"))[uid] == 1


class FakeRay:
    """Ray's ``wait`` / ``get`` over :class:`Member` pings: the StallWatch's logic without a cluster."""

    def wait(self, refs, num_returns, timeout):
        return [r for r in refs if r.answer is not None], [r for r in refs if r.answer is None]

    def get(self, ref):
        if isinstance(ref.answer, Exception):
            raise ref.answer
        return ref.answer


class Ping:
    def __init__(self, member):
        self.answer = member.answer  # None: not answered (yet)


class Member:
    """An actor handle whose ``alive`` ping answers ``answer``: a pid, an error, or None (silent)."""

    def __init__(self, answer):
        self.answer, self.alive = answer, self

    def options(self, concurrency_group):
        assert concurrency_group == "health"
        return self

    def remote(self):
        return Ping(self)


def test_the_stall_watch_takes_down_a_silent_or_replaced_member_once(monkeypatch):
    """A busy worker's members are pinged; one silent (stopped), failing (dead) or answering from
    another process (restarted under its lead) for ``timeout_s`` stalls its worker -- named once;
    members answering from their process keep theirs; a worker no longer busy starts afresh."""
    import sys

    monkeypatch.setitem(sys.modules, "ray", FakeRay())
    actors = {n: Member(1) for n in ("a", "a1", "b", "b1", "c", "d", "d1")}
    members = {"a": ["a", "a1"], "b": ["b", "b1"], "c": ["c"], "d": ["d", "d1"]}
    watch = StallWatch(actors, members, timeout_s=0.2)

    def check_for(seconds, busy):
        stalled, deadline = {}, time.time() + seconds
        while time.time() < deadline:
            stalled.update(watch.check(busy))
            time.sleep(0.01)
        return stalled

    assert check_for(0.1, {"a", "b", "c", "d"}) == {}  # each member answered from its first process
    actors["a1"].answer = None  # stopped
    actors["b1"].answer = RuntimeError("the actor died")  # dead (or restarting)
    actors["d1"].answer = 2  # restarted: another process answers now
    stalled = check_for(0.5, {"a", "b", "c", "d"})
    assert sorted(stalled) == ["a", "b", "d"]
    assert stalled["a"].startswith("a1 gave no answer for 0 s (engine.stall_timeout_s: 0.2) while a ran")
    assert check_for(0.3, {"a", "b", "c", "d"}) == {}  # once (their calls now fail as deaths)
    actors["b1"].answer = 2
    assert check_for(0.3, {"c"}) == {}  # no longer busy: forgotten
    assert check_for(0.3, {"b", "c", "d"}) == {}  # a new call: b1's and d1's new processes answer
