"""Will it fit? ``digenrl plan``'s answer for small clusters: per (model, cluster) the fastest placement
that fits the memory model (the one tests/test_meta_memory_audit.py checks against the meta device), or
the one line saying what would. The table of docs/fit.md.

    python benchmarks/fit_table.py [--models flux1_dev,sd3.5_medium,...] [--clusters 1x24GB,...] [--json F]

Models: the shipped real-scale configs (LoRA, their activation checkpointing / FSDP left to ``auto``
so the planner picks them), Wan2.1-T2V-1.3B by a config-only checkpoint (its published
``transformer/config.json``, written to a temporary directory). Clusters: configs/clusters/<name>.yaml.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json (the fields the planner reads)
WAN_1_3B = {
    "_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 12,
    "attention_head_dim": 128, "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256,
    "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}  # fmt: skip
#: name -> (config, overrides); "{wan13}" is the config-only checkpoint's directory
MODELS = {
    "FLUX.1-dev LoRA": ("flux1_dev.yaml", ["train.activation_checkpointing=auto", "train.fsdp=auto"]),
    "SD3.5-M LoRA": ("sd3.5_medium.yaml", []),
    "Wan2.1-1.3B LoRA": (
        "wan2.1_t2v_14b.yaml",
        ["model.pretrained={wan13}", "train.activation_checkpointing=auto"],
    ),
    "Wan2.1-1.3B LoRA + text-encoder offload": (
        "wan2.1_t2v_14b.yaml",
        [
            "model.pretrained={wan13}",
            "train.activation_checkpointing=auto",
            "model.offload_text_encoders=true",
        ],
    ),
    "Wan2.1-14B LoRA": ("wan2.1_t2v_14b.yaml", ["train.activation_checkpointing=auto"]),
}
CLUSTERS = ["1x24GB", "1x48GB", "2x80GB", "8x40GB"]


def answer(config: str, overrides: list[str], cluster_name: str, iterations: int = 3) -> dict:
    """The fastest fitting plan of ``config`` on ``cluster_name`` (as `digenrl plan` ranks them), or
    the line that says why none fits."""
    from digenrl.cli.plan import plan_row
    from digenrl.config.run import load_config
    from digenrl.errors import UserError
    from digenrl.planner.costmodel import CostModel
    from digenrl.planner.gpus import load_cluster
    from digenrl.planner.search import search
    from digenrl.planner.workload import Workload

    cfg = load_config(ROOT / "configs" / config, overrides)
    cluster = load_cluster(ROOT / "configs" / "clusters" / f"{cluster_name}.yaml")
    try:
        result = search(CostModel(Workload.from_config(cfg), cluster), cluster, top=1, iterations=iterations)
    except UserError as exc:
        return {"fits": False, "why": str(exc)}
    row = plan_row(result.ranked[0], result, 1)
    keep = ("where", "knobs", "notes", "micro_batch", "samples_per_s", "memory_gib")
    return {"fits": True, **{k: row[k] for k in keep}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--clusters", default=",".join(CLUSTERS))
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        wan13 = Path(tmp) / "Wan2.1-T2V-1.3B-Diffusers"
        (wan13 / "transformer").mkdir(parents=True)
        (wan13 / "transformer" / "config.json").write_text(json.dumps(WAN_1_3B))
        (wan13 / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
        for model in args.models.split(","):
            config, sets = MODELS[model]
            sets = [s.replace("{wan13}", str(wan13)) for s in sets]
            for cluster in args.clusters.split(","):
                out[f"{model} | {cluster}"] = a = answer(config, sets, cluster)
                if a["fits"]:
                    notes = ", ".join(a["notes"])
                    line = f"{a['where']}  {a['knobs']}  {notes}  {a['samples_per_s']:.3g} samples/s"
                else:
                    line = a["why"]
                print(f"{model} | {cluster} | {line}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
