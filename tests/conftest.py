import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
torch.set_num_threads(1)  # tiny models: threads only add sync overhead on 2 cores


@pytest.fixture
def tiny_cfg():
    """The default run config (tiny FLUX) at the suite's tiny size (``tests.helpers.TINY``), then
    ``overrides``."""
    from digenrl.config import load_config
    from tests.helpers import TINY

    def make(*overrides: str):
        return load_config(None, [*TINY, *overrides])

    return make


@pytest.fixture(scope="session")
def ray_cluster():
    """The suite's one Ray cluster (2 CPUs, the logical devices of ``tests.helpers.POOLS``), started
    by the first test that asks and shut down at the end of the run; yields its address. Tests that
    need Ray in this process ask for it rather than starting their own."""
    from tests.helpers import local_ray

    yield from local_ray()
