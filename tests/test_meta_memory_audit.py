"""The meta-device memory audit (issue 36, item 4; benchmarks/meta_memory_audit.py): each family's
published transformer on ``meta`` in a fake process group of 8, sharded by the runtime's own
``Policy`` + ``shard_trainer_rank``. No full-size copy may remain on a rank (on 849bed7 the full
fine-tune's KL reference was a whole deep copy, 8x its share), and the rank's bytes by part agree
with planner/memory.py within 10% (on 849bed7: -31% with KL + EMA, the planner replicated the
reference and had no EMA)."""

from __future__ import annotations

import pytest

from tests.test_benchmarks import run_script

pytestmark = pytest.mark.slow

CASES = [
    "flux1_dev full FT + KL + EMA",
    "flux1_dev full FT, diffusion_nft",
    "wan2.1_t2v_14b full FT + KL + EMA",
    "z_image_turbo full FT + KL + EMA",  # its refiner blocks shard as its main layers do
    "flux2_klein_4b full FT + KL + EMA",
]


@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    only = [arg for case in CASES for arg in ("--only", case)]
    # --tag runs "meta_memory_tag.py"'s audit of a TAG trainer rank in the same process
    return run_script("meta_memory_audit.py", tmp_path_factory.mktemp("audit"), *only, "--tag")


def test_every_part_is_sharded_and_agrees_with_the_planner(audit):
    rows = {r["name"]: r for r in audit["rows"]}
    assert set(rows) == set(CASES) and audit["world"] == 8
    for name, r in rows.items():
        assert r["full_size_count"] == 0, f"{name}: full-size tensors on a sharded rank: {r['full_size']}"
        # what FSDP leaves whole by design (Wan's fp32 scale_shift_tables, with their grads, state, EMA)
        assert r["kept_whole_bytes"] < 0.001 * r["total"] and (r["kept_whole_count"] > 0) == ("wan" in name)
        assert abs(r["difference"]) < 0.10, f"{name}: {r['total']} bytes held, planner {r['planner']}"
        held = r["held"]
        # each fp32 part is this rank's 1/8 of the trained weights (hand count: 4 bytes x params / 8)
        share = 4 * r["params"] / 8
        for part in ("fp32 masters", "fp32 grads"):
            assert abs(held[part] - share) < 0.01 * share, (name, part)
        assert abs(held["AdamW state"] - 2 * share) < 0.01 * share, name
    flux, nft = rows[CASES[0]]["held"], rows[CASES[1]]["held"]
    assert flux["reference"] > 0 and flux["EMA"] > 0 and flux["old policy"] == 0
    assert abs(flux["reference"] - flux["fp32 masters"] / 2) < 0.01 * flux["reference"]  # bf16 shards
    assert nft["old policy"] == nft["fp32 masters"] and nft["reference"] == 0


def test_a_tag_rank_rolling_out_holds_what_the_planner_charges(audit):
    """FLUX.1-dev LoRA, rank 0 of 8, a TAG unit of 4 groups (issue 52): its shards, fp32 masters,
    accumulated gradients and AdamW state as the training rows; FSDP2's gathered copy (the two largest
    blocks -- FLUX's double-stream ones, 1.6x the average block the planner used before -- and the
    root's parameters); the trajectory the sampler itself allocates."""
    (r,) = audit["tag_rows"]
    held, planned = r["held"], r["planner_parts"]
    assert r["full_size_count"] == 0 and r["world"] == 8
    for part in ("frozen base", "fp32 masters", "fp32 grads", "AdamW state"):
        assert held[part] == pytest.approx(planned[part], rel=0.01), part
    assert held["trajectory"] == planned["trajectory"]  # the sampler's buffers, by the planner's formula
    gathered = held["gathered blocks"] + held["gathered root"]
    assert gathered == pytest.approx(planned["compute copy"], rel=0.05)  # (LoRA's bf16 copies: the rest)
    assert held["gathered blocks"] > 1.5 * held["gathered root"] > 0
    assert abs(r["difference"]) < 0.05
