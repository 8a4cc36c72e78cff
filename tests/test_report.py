"""`digenrl report RUN` (issue 56): one HTML page that opens offline -- a curve per reward component
whose points are the metrics rows, the sample grids and the timeline embedded, nothing fetched."""

import base64
import json
import re
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from digenrl.cli.app import main


def fake_run(run, n=9):
    """A run directory as train writes it: config, metrics rows, two sample grids, a timeline."""
    (run / "samples").mkdir(parents=True)
    (run / "config.yaml").write_text("train: {iterations: 9}\n")
    rows = [
        {
            "iteration": i,
            "reward_mean": 0.1 * i,
            "reward/a": 0.1 * i,
            "reward/b": 0.5,
            "clip_frac": 0.0,
            "kl": 0.0,
        }
        for i in range(n)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i, colour in ((0, "red"), (8, "blue")):
        Image.new("RGB", (8, 8), colour).save(run / "samples" / f"iter-{i:06d}.png")
    Image.new("RGB", (20, 10), "green").save(run / "timeline.png")
    return run


def test_the_page_holds_every_curve_and_image_and_fetches_nothing(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path / "run")
    monkeypatch.setattr(sys, "argv", ["digenrl", "report", str(run)])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 0 and f"wrote {run / 'report.html'}" in capsys.readouterr().out
    page = (run / "report.html").read_text()
    curves = dict(re.findall(r'<polyline data-series="([^"]+)"[^>]*points="([^"]+)"', page))
    assert {"reward_mean", "reward/a", "reward/b"} <= set(curves)
    assert all(len(curves[k].split()) == 9 for k in ("reward_mean", "reward/a", "reward/b"))
    ys = [float(p.split(",")[1]) for p in curves["reward/a"].split()]
    assert ys == sorted(ys, reverse=True)  # a rising reward climbs the page (SVG y grows downwards)
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3  # two sample grids and the timeline, embedded byte for byte
    assert base64.b64decode(images[-1]) == (run / "timeline.png").read_bytes()
    assert not re.search(r'(src|href)="(https?:)?//', page)  # offline: nothing to fetch


def test_a_directory_without_a_run_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["digenrl", "report", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert (
        exc.value.code == 2
        and err
        == f"error: RUN: {tmp_path} holds no metrics.jsonl (not a run directory, or one not yet started)\n"
    )


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs a headless browser (Debian's chromium)")
def test_the_page_renders_offline_in_a_headless_browser(tmp_path):
    """Debian's chromium, offline, draws the embedded images and the curves: their exact colours are in
    its screenshot (solid sample grids, drawn pixelated; each curve point a dot of its colour, within
    antialiasing)."""
    from digenrl.run.report import write_report

    page = write_report(fake_run(tmp_path / "run"))
    shot = tmp_path / "shot.png"
    argv = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    argv += ["--window-size=1000,2000", f"--screenshot={shot}", page.as_uri()]
    subprocess.run(argv, capture_output=True, timeout=120, check=True)
    img = Image.open(shot).convert("RGB")
    colours = {img.getpixel((x, y)) for x in range(img.width) for y in range(img.height)}
    assert {(255, 0, 0), (0, 0, 255), (0, 128, 0)} <= colours  # the two sample grids, the timeline
    for curve in ((0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28)):  # two curves' dots (antialiased: near)
        assert any(max(abs(a - b) for a, b in zip(c, curve)) <= 12 for c in colours), curve


def test_sample_grids_reach_tensorboard_as_images(tmp_path):
    """RunDir.log_image (called where a run saves samples/iter-*.png): the grid, pixel for pixel, as a
    TensorBoard image at the iteration's step."""
    import io

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from digenrl.config.run import load_config
    from digenrl.run.rundir import RunDir

    grid = tmp_path / "grid.png"
    Image.new("RGB", (12, 6), (10, 200, 30)).save(grid)
    out = RunDir(load_config(None, ["output.tensorboard=true"]), tmp_path / "run")
    out.log_image(grid, 30)
    out.close()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    (logged,) = events.Images("samples")
    assert logged.step == 30 and (logged.width, logged.height) == (12, 6)
    assert Image.open(io.BytesIO(logged.encoded_image_string)).convert("RGB").getpixel((5, 3)) == (
        10,
        200,
        30,
    )
