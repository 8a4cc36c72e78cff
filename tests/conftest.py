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
def pytest_collection_modifyitems(config, items):
    """The order of the run. The tests marked ``faults`` that use the suite's Ray cluster come after
    its other tests: their runs start fresh actors on every device, releasing all kept ones (warm
    workers), so the runs after them would start theirs again.

    Under pytest-xdist (``./dev.sh test``: 2 workers, ``--dist loadgroup --no-loadscope-reorder``)
    the tests on the suite's Ray cluster are one group, run on one worker in that order (one
    cluster per run, its warm workers reused as in one process); every other test file is a group
    of its own (its module fixtures built once), and the files with slow tests go first, so the
    many quick tests fill the end of the run."""
    on_ray = {id(item) for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    late = [item for item in items if id(item) in on_ray and item.get_closest_marker("faults")]
    items[:] = [item for item in items if item not in late] + late
    if not getattr(config.option, "loadgroup", False):  # (what an xdist worker of --dist loadgroup sees)
        return
    for item in items:
        group = "ray_cluster" if id(item) in on_ray else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        return 0 if id(item) in on_ray else 1 if item.nodeid.split("::")[0] in slow else 2

    items.sort(key=rank)  # (stable: file order within each)


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
