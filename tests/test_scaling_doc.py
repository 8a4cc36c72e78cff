"""docs/scaling.md holds exactly the tables ``docs/scaling/generate.py --markdown`` makes from
predictions.json, and on every row DigenRL (the planner's pick) is at least every baseline of our
engine: the engine runs every plan the search proposes, the baselines' arrangements included."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ROOT / "docs" / "scaling" / "generate.py"


def _generator():
    spec = importlib.util.spec_from_file_location("scaling_generate", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scaling_doc_holds_the_generated_tables():
    tables = _generator().markdown().strip()
    assert tables.startswith("### Calibration on published numbers")
    assert tables in (ROOT / "docs" / "scaling.md").read_text(), (
        "docs/scaling.md is out of date: paste `python docs/scaling/generate.py --markdown` into it"
    )


def test_digenrl_is_at_least_every_baseline_of_our_engine_on_every_row():
    rows = json.loads((ROOT / "docs" / "scaling" / "predictions.json").read_text())
    searched = {k: r for k, r in rows.items() if isinstance(r, dict) and "best_sps" in r}
    assert len(searched) == 44  # 11 models x 4 clusters
    for key, r in searched.items():
        assert r["digenrl"]["sps"] == r["best_sps"], key
        if r.get("disaggregated"):
            assert r["disaggregated"]["sps"] <= r["best_sps"] * (1 + 1e-9), key
        for name, base in r["baselines"].items():
            if base is not None:
                assert r["best_sps"] >= base["sps"] * (1 - 1e-9), (key, name, r["best_sps"], base["sps"])
