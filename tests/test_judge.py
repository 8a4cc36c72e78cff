"""A VLM judge priced from its architecture (digenrl/planner/judge.py): its terms by hand, and its
parameter counts against transformers' real classes on the meta device."""

from __future__ import annotations

import pytest

from digenrl.placement.devices import DEVICES
from digenrl.planner import judge as j


def test_a_decode_step_reads_the_weights_once_and_every_requests_kv():
    dev = DEVICES["H800"]
    m = j.UNIFIED_REWARD_THINK_32B
    assert m.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2  # K and V, 64 layers, 8 heads of 128, bf16
    assert m.input_tokens(512 * 512) == 256 + 40  # 32 px per visual token after the 2 x 2 merge
    bw = dev.mem_bw * 0.7
    one = m.decode_step_s(1, 400, dev, 0.5, 0.7)
    assert one == pytest.approx((m.params * 2 + 400 * m.kv_bytes_per_token) / bw)
    many = m.decode_step_s(64, 400, dev, 0.5, 0.7, seq_s=1e-4)
    assert many - one == pytest.approx(63 * 400 * m.kv_bytes_per_token / bw + 64 * 1e-4)
    # past the batch where the matmuls outlast the weight read, the step is compute-bound
    huge = m.decode_step_s(4096, 0, dev, 0.5, 0.7)
    assert huge == pytest.approx(4096 * 2 * m.params / (dev.bf16_flops * 0.5))


def test_the_tail_is_the_last_prefill_and_an_answer_of_steps():
    dev = DEVICES["H800"]
    m = j.UNIFIED_REWARD_THINK_32B
    px = 512 * 512
    prefill = 16 * 296 * 2 * m.params / (dev.bf16_flops * 0.5)
    assert m.prefill_s(16, px, dev, 0.5) == pytest.approx(prefill)
    step = m.decode_step_s(64, 296 + 128, dev, 0.5, 0.7, 2e-4)
    assert m.tail_s(16, 64, px, dev, 0.5, 0.7, 2e-4) == pytest.approx(prefill + 256 * step)


@pytest.mark.parametrize("name", sorted(j.CONFIGS))
def test_the_judges_parameters_are_the_real_classes(name):
    model = next(m for m in (j.UNIFIED_REWARD_THINK_32B, j.QWEN25_VL_3B_OCR) if m.name == name)
    assert j.count_params(name) == pytest.approx(model.params, rel=1e-3)
