import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
torch.set_num_threads(1)  # tiny models: threads only add sync overhead on 2 cores


@pytest.fixture
def tiny_cfg():
    """The default run config (tiny FLUX) with small sizes for fast tests."""
    from digenrl.config import load_config

    def make(*overrides: str):
        return load_config(None, list(overrides))

    return make
