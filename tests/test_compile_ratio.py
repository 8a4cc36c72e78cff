"""A compiled rollout keeps the on-policy ratio at exactly 1 where the batch matches (issue 36, item 7):
the rollout samples through ``torch.compile`` (``backend="aot_eager"``: the graph capture and AOT
autograd of the GPU path, the eager kernels, so no fusion changes the numbers on this CPU), the
trainer recomputes eagerly in grad mode in the same batches: ``logprob_mismatch`` must be 0."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY

pytestmark = pytest.mark.slow


def test_compiled_rollout_has_no_logprob_mismatch():
    from digenrl.config.run import load_config
    from digenrl.engine.local import LocalTrainer
    from digenrl.units.advantages import assign_advantages
    from digenrl.units.train import merge_stats, train_unit

    t = LocalTrainer(load_config(None, [*TINY, "train.lr=1e-2", "train.micro_batch=4"]))
    t.iteration(0)  # LoRA off its zero init: the check runs on trained weights
    net = t.policy.adapter.transformer
    net.forward = torch.compile(net.forward, backend="aot_eager", dynamic=False)
    try:
        units = t.rollout(1)
    finally:
        del net.forward  # the trainer's forwards are eager
    assign_advantages(units, t.cfg)
    terms = sum(len(u) * u.train_idx.shape[1] for u in units)
    st = merge_stats([train_unit(t.policy, u, terms) for u in units])
    assert len(units) > 0 and all(u.latents.isfinite().all() for u in units)
    assert st["logprob_mismatch"] == 0.0
    assert st["ratio_min"] == st["ratio_max"] == 1.0
