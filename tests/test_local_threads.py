"""The single-process trainer on CPU runs torch at one thread, as the engine's CPU workers do."""

import torch

from digenrl.config.run import load_config
from digenrl.engine.local import LocalTrainer
from tests.helpers import TINY


def test_the_local_trainer_on_cpu_uses_one_thread():
    # torch's default is one thread per core: on 2 cores shared with other jobs, 2 threads made the
    # small world's iterations 20x slower than 1 (benchmarks/RESULTS.md)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        LocalTrainer(load_config(None, [*TINY, "train.device=cpu", "output.tensorboard=false"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
