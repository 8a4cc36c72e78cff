"""Will it fit (issue 56): the memory model counts text encoders kept on the CPU as the runtime keeps
them, a refusal names the setting that would fit, a one-device cluster plans (its disaggregated
baseline: none), and benchmarks/"fit_table.py" answers docs/fit.md's small clusters."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from digenrl.config.run import load_config
from digenrl.errors import UserError
from digenrl.planner.costmodel import CostModel
from digenrl.planner.gpus import load_cluster
from digenrl.planner.memory import HALF_BYTES
from digenrl.planner.search import baselines, search
from digenrl.planner.workload import Workload

ROOT = Path(__file__).resolve().parents[1]


def cost(config: str, cluster: str, sets=()):
    cl = load_cluster(ROOT / "configs" / "clusters" / f"{cluster}.yaml")
    return CostModel(Workload.from_config(load_config(ROOT / "configs" / config, list(sets))), cl), cl


def test_offloaded_text_encoders_leave_the_rollout_models_by_their_bytes():
    c, _ = cost("sd3.5_medium.yaml", "1x24GB")
    on = CostModel(replace(c.workload, text_offload=True), c.cluster)
    text = c.workload.shape.text_encoder_params
    assert text > 1e9  # SD3.5's CLIP-L, CLIP-G and T5-XXL
    assert c.memory.rollout_models() - on.memory.rollout_models() == pytest.approx(HALF_BYTES * text)
    offload = Workload.from_config(
        load_config(ROOT / "configs" / "sd3.5_medium.yaml", ["model.offload_text_encoders=true"])
    )
    assert offload.text_offload and not c.workload.text_offload


def test_a_one_device_cluster_plans_and_has_no_disaggregated_baseline():
    """`plan` on 1 GPU crashed (ValueError from min() of no candidates) computing the baselines."""
    c, cl = cost("sd3.5_medium.yaml", "1x48GB")
    assert search(c, cl, top=1, iterations=2).ranked
    assert baselines(c, cl, iterations=2)["separate_async"] is None


def test_a_refusal_names_what_would_fit():
    c, cl = cost("flux1_dev.yaml", "1x24GB")
    with pytest.raises(UserError, match="fits no placement of cluster 1x24GB") as exc:
        search(c, cl, top=1, iterations=2)
    assert "offload_text_encoders" not in str(exc.value)  # FLUX.1-dev's own weights do not fit 24 GB


def test_fit_table_answers_the_small_clusters():
    spec = importlib.util.spec_from_file_location("fit_table", ROOT / "benchmarks" / "fit_table.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    models = "Wan2.1-1.3B LoRA,Wan2.1-1.3B LoRA + text-encoder offload"
    out = fit.main(["--models", models, "--clusters", "1x24GB"])
    plain = out["Wan2.1-1.3B LoRA | 1x24GB"]
    offloaded = out["Wan2.1-1.3B LoRA + text-encoder offload | 1x24GB"]
    assert not plain["fits"] and "with model.offload_text_encoders: true it fits" in plain["why"]
    assert offloaded["fits"] and offloaded["where"] == "colocated 1xRTX4090"
