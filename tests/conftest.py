import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray starts its workers at niceness 15: beside any busy process (another user's job, a benchmark) the
# suite's actors then get a few percent of a core, and a run that takes 20 s alone takes minutes and
# trips the engine's own waits (a placement group's 30 s, a test's deadline). The suite's actors, and
# those of the subprocesses it starts (they inherit the environment), run at the suite's own priority.
os.environ.setdefault("RAY_worker_niceness", "0")
torch.set_num_threads(1)  # tiny models: threads only add sync overhead on 2 cores


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``./dev.sh test`` runs 2 workers, ``--dist loadgroup``) the tests that use
    the suite's Ray cluster run on one worker, in order: one cluster per run, and its warm workers
    reused as in a serial run; the other tests spread over both workers. Of those, the tests marked
    ``faults`` run last: their runs start fresh actors on every device, releasing all kept ones, so
    the next runs would start theirs again."""
    on_ray = [item for item in items if "ray_cluster" in getattr(item, "fixturenames", ())]
    for item in on_ray:
        item.add_marker(pytest.mark.xdist_group("ray_cluster"))
    late = [item for item in on_ray if item.get_closest_marker("faults")]
    items[:] = [item for item in items if item not in late] + late


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
    need Ray in this process ask for it rather than starting their own.

    Engine runs inside it keep warm workers (:mod:`digenrl.engine.warm`): a run builds its workers
    in the processes a finished run kept (the same worker, the same kind) instead of starting fresh
    ones (~5 s of CPU each); a run that needs the devices kept actors hold releases them first."""
    from digenrl.engine.warm import warm_workers
    from tests.helpers import local_ray

    with warm_workers():
        yield from local_ray()
