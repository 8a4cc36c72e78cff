"""Timeline: Chrome trace schema, bubble fraction in closed form, Gantt PNG. No Ray needed."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from digenrl.engine.timeline import Timeline
from tests.helpers import FULL_MODE


def pipeline() -> Timeline:
    """1 rollout worker + 1 trainer, 2 iterations, hand-made (seconds):

    rollout0: rollout k0 [0,2]  sync v1 [3,3.5]  rollout k1 [3.5,5.5]
    trainer0: train  k0 [2,3]   step k0 [3,3.25] (publish [3.2,3.25])  train k1 [5.5,6.5]  step k1 [6.5,7]
    """
    tl = Timeline()
    tl.add_worker("rollout0", "rollout")
    tl.add_worker("trainer0", "trainer")
    tl.record("rollout0", "rollout", "rollout-0-0", 0, 0, 0.0, 2.0, samples=8, groups=[0])
    tl.record("rollout0", "reward", "rollout-0-0", 0, 0, 1.8, 2.0)
    tl.record("trainer0", "train", "train-0-0-0", 0, 0, 2.0, 3.0, sample_versions=[0], groups=[0])
    tl.record("trainer0", "step", "step-0/trainer0", 0, 0, 3.0, 3.25)
    tl.record("trainer0", "sync", "sync-1-publish", 0, 1, 3.2, 3.25, direction="publish", bytes=100)
    tl.record("rollout0", "sync", "sync-1-fetch", 1, 1, 3.0, 3.5, direction="fetch", bytes=100)
    tl.record("rollout0", "rollout", "rollout-1-0", 1, 1, 3.5, 5.5, samples=8, groups=[0])
    tl.record("trainer0", "train", "train-1-0-0", 1, 1, 5.5, 6.5, sample_versions=[1], groups=[0])
    tl.record("trainer0", "step", "step-1/trainer0", 1, 1, 6.5, 7.0)
    return tl


def test_chrome_trace_schema():
    tl = pipeline()
    trace = tl.to_chrome_trace()
    json.dumps(trace)  # serialisable as is
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    units = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(units) == len(tl.events)
    pools = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    workers = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert set(pools.values()) == {"rollout", "trainer"} and set(workers.values()) == {"rollout0", "trainer0"}
    for e in units:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["dur"] >= 0
        assert pools[e["pid"]] == tl.workers[workers[(e["pid"], e["tid"])]]  # the worker sits in its pool
        args = e["args"]
        assert args["kind"] in ("rollout", "train", "step", "sync", "reward")
        assert {"kind", "unit", "iteration", "version"} <= args.keys()
        if args["kind"] == "train":
            assert isinstance(args["sample_versions"], list)
    first_train = next(e for e in units if e["args"]["kind"] == "train")
    assert first_train["ts"] == 2.0e6 and first_train["dur"] == 1.0e6  # microseconds
    assert first_train["args"]["sample_versions"] == [0]
    # and back: the same events
    again = Timeline.from_chrome_trace(trace)
    assert again.workers == tl.workers
    key = lambda e: (e.worker, e.kind, e.uid, e.start)  # noqa: E731
    for a, b in zip(sorted(again.events, key=key), sorted(tl.events, key=key)):
        assert (a.kind, a.uid, a.iteration, a.version, a.sample_versions) == (
            b.kind,
            b.uid,
            b.iteration,
            b.version,
            b.sample_versions,
        )
        assert a.start == pytest.approx(b.start) and a.end == pytest.approx(b.end) and a.args == b.args


def test_bubble_fraction_closed_form():
    tl = pipeline()
    spans = tl.iteration_spans()
    assert spans == {0: (0.0, 3.25), 1: (3.25, 7.0)}
    stats = {r["iteration"]: r for r in tl.iteration_stats()}
    # iteration 0, [0, 3.25] x 2 workers: rollout0 busy [0,2] + [3,3.25] (its fetch) = 2.25,
    # trainer0 busy [2,3.25] = 1.25 (the publish nests in the step) -> 1 - 3.5 / 6.5
    assert stats[0]["bubble_fraction"] == pytest.approx(1 - 3.5 / 6.5)
    # iteration 1, [3.25, 7]: rollout0 [3.25,5.5] = 2.25; trainer0 [5.5,7] = 1.5 -> 1 - 3.75 / 7.5
    assert stats[1]["bubble_fraction"] == pytest.approx(1 - 3.75 / 7.5)
    assert stats[0]["samples_per_s"] == pytest.approx(8 / 3.25)
    assert stats[1]["samples_per_s"] == pytest.approx(8 / 3.75)
    assert stats[0]["sync_bytes"] == 100 and stats[1]["sync_bytes"] == 100
    assert stats[1]["sync_s"] == pytest.approx(0.5) and stats[0]["sync_s"] == pytest.approx(0.05)
    assert stats[0]["rollout_device_s"] == pytest.approx(2.0) and stats[0]["train_device_s"] == pytest.approx(
        1.25
    )
    whole = tl.summary()
    assert whole["samples_per_s"] == pytest.approx(16 / 7.0)
    assert whole["bubble_fraction"] == pytest.approx(1 - (3.5 + 3.75) / 14.0)
    assert tl.summary(skip=1)["samples_per_s"] == pytest.approx(8 / 3.75)
    assert tl.summary(tail=1)["bubble_fraction"] == pytest.approx(1 - 3.5 / 6.5)


def test_idle_worker_counts_in_the_bubble():
    tl = Timeline()
    tl.add_worker("a", "p")
    tl.add_worker("b", "p")  # never gets work
    tl.record("a", "rollout", "rollout-0-0", 0, 0, 0.0, 1.0, samples=4)
    tl.record("a", "step", "step-0/a", 0, 0, 1.0, 2.0)
    assert tl.iteration_stats()[0]["bubble_fraction"] == pytest.approx(0.5)


def test_reward_service_row_is_drawn_but_not_a_device(tmp_path):
    tl = pipeline()
    before = [r["bubble_fraction"] for r in tl.iteration_stats()]
    tl.add_worker("reward", "service")
    tl.record("reward", "reward", "rollout-0-0", 0, 0, 2.0, 2.6, service=True)  # beside the next work
    again = Timeline.from_chrome_trace(tl.to_chrome_trace())
    assert again.workers["reward"] == "service"
    assert [r["bubble_fraction"] for r in again.iteration_stats()] == pytest.approx(before)
    tl.to_png(tmp_path / "t.png")


def test_rejects_bad_events():
    tl = Timeline()
    with pytest.raises(ValueError):
        tl.record("a", "nap", "x", 0, 0, 0.0, 1.0)
    with pytest.raises(ValueError):
        tl.record("a", "train", "x", 0, 0, 2.0, 1.0)


def test_png_written(tmp_path):
    path = pipeline().to_png(tmp_path / "timeline.png")
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width > 400 and img.height > 60
        colours = {c for _, c in img.getcolors(maxcolors=1 << 16)}
    assert (66, 133, 244) in colours and (244, 160, 0) in colours  # rollout v0 and train v0 drawn
    assert Timeline().to_png(tmp_path / "empty.png").exists()  # an empty run still draws


def long_run(iterations: int) -> Timeline:
    """The pipeline's pattern repeated: rollout 2 s, then train 1 s + step 0.25 s; workers start up first."""
    tl = Timeline()
    tl.add_worker("rollout0", "rollout")
    tl.add_worker("trainer0", "trainer")
    tl.record("rollout0", "start", "start-rollout0", 0, 0, 0.0, 5.0)
    tl.record("trainer0", "start", "start-trainer0", 0, 0, 0.0, 5.0)
    t = 5.0
    for k in range(iterations):
        tl.record("rollout0", "rollout", f"rollout-{k}-0", k, k, t, t + 2.0, samples=8)
        tl.record("trainer0", "train", f"train-{k}-0-0", k, k, t + 2.0, t + 3.0, sample_versions=[k])
        tl.record("trainer0", "step", f"step-{k}/trainer0", k, k, t + 3.0, t + 3.25)
        t += 3.25
    return tl


def test_long_run_png_reads_at_any_length(tmp_path):
    """120 iterations: the detail panel shows only the last 3 (labelled units), the strip the whole
    run with start-up; the legend names only the kinds drawn (no reward, no sync here)."""
    from digenrl.engine.timeline_draw import COLOURS, LABEL_W, _strip

    tl = long_run(120)
    assert tl.iteration_spans()[0][0] == 5.0  # start-up precedes the first iteration's span
    with Image.open(tl.to_png(tmp_path / "long.png", window=3)) as img:
        colours = {c for _, c in img.getcolors(maxcolors=1 << 16)}
    assert COLOURS["reward"] not in colours and COLOURS["sync"] not in colours  # not in the legend either
    assert COLOURS["start"] in colours and COLOURS["rollout"] in colours and COLOURS["train"] in colours
    # the strip: the first columns of each row are start-up, then the rollout worker alternates busy / idle
    drawn = set()
    rollout = _strip(tl, ["rollout0"], 0.0, tl.events[-1].end, 3950, drawn)  # 0.1 s a column
    assert rollout[0] == COLOURS["start"] and drawn == {"start", "rollout"}
    busy = sum(1 for c in rollout if c is not None) / len(rollout)
    assert 0.6 < busy < 0.7  # 5 s start + 120 x 2 s rollout of 395 s: 0.62 busy (+ part-busy columns)
    assert LABEL_W > 0


def test_legend_lists_only_drawn_kinds(tmp_path):
    tl = Timeline()
    tl.add_worker("rollout0", "rollout")
    tl.record("rollout0", "rollout", "rollout-0-0", 0, 0, 0.0, 1.0, samples=4)
    from digenrl.engine.timeline_draw import COLOURS

    with Image.open(tl.to_png(tmp_path / "one.png")) as img:
        colours = {c for _, c in img.getcolors(maxcolors=1 << 16)}
    assert COLOURS["rollout"] in colours
    assert not {COLOURS[k] for k in ("train", "step", "sync", "reward", "start")} & colours


# -- multi-device workers: sequence-parallel groups and FSDP shard groups ------------------------


def with_followers_replicated(tl: Timeline) -> Timeline:
    """The equivalent run of 1-device workers: every follower becomes a worker of its own that runs
    its lead's units at the same times (the reference the grouped bubble must equal)."""
    flat = Timeline()
    for w, pool in tl.workers.items():
        flat.add_worker(w, pool)
    for e in tl.events:
        flat.add(e)
        for device in (d for d in tl.workers if d in tl.follows and tl.lead_of(d) == e.worker):
            flat.record(
                device, e.kind, e.uid, e.iteration, e.version, e.start, e.end, e.sample_versions, **e.args
            )
    return flat


def sp_pipeline() -> Timeline:
    """:func:`pipeline` with its rollout worker a sequence-parallel pair (rollout0 leads rollout1)."""
    tl = Timeline()
    tl.add_worker("rollout0", "rollout")
    tl.add_worker("rollout1", "rollout", follows="rollout0")
    tl.add_worker("trainer0", "trainer")
    for e in pipeline().events:
        tl.add(e)
    return tl


def test_sequence_parallel_follower_is_busy_with_its_lead():
    tl = sp_pipeline()
    stats = {r["iteration"]: r for r in tl.iteration_stats()}
    # iteration 0, [0, 3.25] x 3 devices: rollout0 and rollout1 busy 2.25 each, trainer0 1.25
    assert stats[0]["bubble_fraction"] == pytest.approx(1 - (2 * 2.25 + 1.25) / (3 * 3.25))
    # iteration 1, [3.25, 7]: 2 x 2.25 + 1.5 of 3 x 3.75
    assert stats[1]["bubble_fraction"] == pytest.approx(1 - (2 * 2.25 + 1.5) / (3 * 3.75))
    # the same bubble as the equivalent run of three 1-device workers
    flat = with_followers_replicated(tl)
    assert not flat.follows and len(flat.events) > len(tl.events)
    assert [r["bubble_fraction"] for r in tl.iteration_stats()] == pytest.approx(
        [r["bubble_fraction"] for r in flat.iteration_stats()]
    )
    assert tl.summary()["bubble_fraction"] == pytest.approx(flat.summary()["bubble_fraction"])
    # the samples are the lead's: a follower adds devices, not samples
    assert tl.summary()["samples_per_s"] == pytest.approx(pipeline().summary()["samples_per_s"])


def test_follower_events_of_its_own_count_once():
    tl = sp_pipeline()
    before = tl.iteration_stats()[0]["bubble_fraction"]
    tl.record(
        "rollout1", "sync", "sync-1-fetch", 1, 1, 3.0, 3.5, direction="fetch"
    )  # inside rollout0's busy time
    assert tl.iteration_stats()[0]["bubble_fraction"] == pytest.approx(before)
    tl.record("rollout1", "start", "start-rollout1", 0, 0, 2.0, 3.0)  # its own, while rollout0 idles
    assert tl.iteration_stats()[0]["bubble_fraction"] == pytest.approx(before - 1.0 / (3 * 3.25))


def test_fsdp_group_with_sequence_parallel_leads_resolves_to_rank0():
    """SP inside FSDP: trainer1..3 follow rank 0 (trainer3 through its SP lead trainer2)."""
    tl = Timeline()
    tl.add_worker("rollout0", "rollout")
    tl.add_worker("trainer0", "trainer")
    tl.add_worker("trainer1", "trainer", follows="trainer0")
    tl.add_worker("trainer2", "trainer", follows="trainer0")
    tl.add_worker("trainer3", "trainer", follows="trainer2")
    assert [tl.lead_of(w) for w in tl.workers] == ["rollout0"] + ["trainer0"] * 4
    assert tl.groups() == {
        "rollout0": ["rollout0"],
        "trainer0": ["trainer0", "trainer1", "trainer2", "trainer3"],
    }
    tl.record("rollout0", "rollout", "rollout-0-0", 0, 0, 0.0, 1.0, samples=4)
    tl.record("trainer0", "train", "train-0-0-0", 0, 0, 1.0, 2.0, sample_versions=[0])
    tl.record("trainer0", "step", "step-0/trainer0", 0, 0, 2.0, 2.5)
    # [0, 2.5] x 5 devices: rollout0 busy 1, each of the 4 trainer devices 1.5
    assert tl.iteration_stats()[0]["bubble_fraction"] == pytest.approx(1 - (1 + 4 * 1.5) / (5 * 2.5))


def test_groups_survive_the_chrome_trace_and_draw_as_one_row(tmp_path):
    tl = sp_pipeline()
    trace = tl.to_chrome_trace()
    names = [e["args"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert {"name": "rollout1", "follows": "rollout0"} in names and {"name": "rollout0"} in names
    again = Timeline.from_chrome_trace(trace)
    assert again.follows == {"rollout1": "rollout0"}
    assert [r["bubble_fraction"] for r in again.iteration_stats()] == pytest.approx(
        [r["bubble_fraction"] for r in tl.iteration_stats()]
    )
    # one row per scheduled worker: the pair draws as tall as the 1-device pipeline, not a row more
    grouped, one = tl.to_png(tmp_path / "sp.png"), pipeline().to_png(tmp_path / "one.png")
    with Image.open(grouped) as grouped, Image.open(one) as one:
        assert grouped.size == one.size
    flat = Timeline()
    for w, pool in tl.workers.items():
        flat.add_worker(w, pool)  # the same devices, not grouped: a row more
    with Image.open(flat.to_png(tmp_path / "flat.png")) as ungrouped:
        assert ungrouped.height > one.height


def test_group_leads_of_the_engine_config():
    """The runtime's follower -> lead map (no Ray): FSDP ranks follow rank 0, SP followers their lead."""
    from digenrl.config.run import load_config
    from digenrl.placement.resolve import resolve

    def leads(*sets):
        return resolve(load_config(None, [*FULL_MODE, "engine.tag=false", *sets])).leads

    assert leads(
        "engine.rollout_sp=2", "cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 1}]"
    ) == {"rollout1": "rollout0"}
    assert leads(
        "engine.trainer_sp=2",
        "train.fsdp=4",
        "engine.tsp_degree=1",
        "cluster.pools=[{name: rollout, count: 1}, {name: trainer, count: 4}]",
    ) == {"trainer1": "trainer0", "trainer2": "trainer0", "trainer3": "trainer0"}
    assert leads("cluster.pools=[{name: rollout, count: 2}, {name: trainer, count: 2}]") == {}


def test_a_resumed_run_keeps_the_earlier_timeline(tmp_path):
    """After Ctrl-C and --resume, timeline.json is the whole run's: the interrupted run's iterations
    before the checkpoint (its partial iteration 1 was run again and is dropped), then the resumed
    run's, shifted after them. Each iteration's units and step appear once and the spans tile."""
    earlier = pipeline()
    earlier.record("rollout0", "rollout", "rollout-2-0", 2, 1, 5.5, 6.0, samples=8, groups=[0])  # cut off
    path = earlier.save_json(tmp_path / "timeline.json")
    resumed = Timeline()  # resumed from the checkpoint of iteration 1: runs iterations 1 and 2
    resumed.add_worker("rollout0", "rollout")
    resumed.add_worker("trainer0", "trainer")
    resumed.record("rollout0", "start", "start-rollout0", 0, 0, 0.0, 1.0)
    for k, t in ((1, 1.0), (2, 3.0)):
        resumed.record("rollout0", "rollout", f"rollout-{k}-0", k, k, t, t + 1, samples=8, groups=[0])
        resumed.record("trainer0", "train", f"train-{k}-0-0", k, k, t + 1, t + 1.5, sample_versions=[k])
        resumed.record("trainer0", "step", f"step-{k}/trainer0", k, k, t + 1.5, t + 2)
    whole = resumed.after_earlier(path, from_iteration=1)
    assert [(e.iteration, e.uid) for e in whole.of("step")] == [
        (0, "step-0/trainer0"),
        (1, "step-1/trainer0"),
        (2, "step-2/trainer0"),
    ]
    assert sorted((e.iteration, e.uid) for e in whole.of("rollout")) == [
        (0, "rollout-0-0"),
        (1, "rollout-1-0"),
        (2, "rollout-2-0"),
    ]
    kept_end = 3.25  # the earlier events kept end with iteration 0's step and sync
    assert min(e.start for e in whole.events if e.uid.startswith(("start", "rollout-1"))) >= kept_end
    spans = whole.iteration_spans()
    assert list(spans) == [0, 1, 2]
    assert all(spans[k][1] == spans[k + 1][0] for k in (0, 1))  # the spans tile the whole run
    reread = Timeline.from_chrome_trace(whole.to_chrome_trace())
    assert len(reread.events) == len(whole.events)
    assert resumed.after_earlier(tmp_path / "none.json", 1) is resumed  # nothing earlier: unchanged
