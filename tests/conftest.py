import os

# One OpenMP thread in every process the suite starts (a `digenrl` CLI run, a benchmark script, the
# GPU check's dry run), as in this one (below) and in the engine's CPU workers: beside the other
# xdist worker, a second thread only spins (the GPU check's call costs: 19 s of CPU with two, 4 s
# with one; benchmarks/RESULTS.md, "The test suite").
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray starts its workers at niceness 15: beside any busy process (another user's job, a benchmark) the
# suite's actors then get a few percent of a core, and a run that takes 20 s alone takes minutes and
# trips the engine's own waits (a placement group's 30 s, a test's deadline). The suite's actors, and
# those of the subprocesses it starts (they inherit the environment), run at the suite's own priority.
os.environ.setdefault("RAY_worker_niceness", "0")
torch.set_num_threads(1)  # tiny models: threads only add sync overhead on 2 cores


#: The xdist group of every test on the suite's Ray cluster (:func:`pytest_collection_modifyitems`).
RAY_GROUP = "ray_cluster"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``./dev.sh test``: 2 workers, ``--dist loadgroup``) the tests on the suite's
    Ray cluster are one group (:data:`RAY_GROUP`), run on one worker in order on that worker's
    cluster, its warm workers reused as in one process; every other test goes to whichever worker is
    free, so the two workers finish together. (The ``faults`` tests as a second group on the other
    worker's cluster cost more than they spread: a second cluster, and a second pool starting the same
    kinds of actors; benchmarks/RESULTS.md, "The test suite".)"""
    on_ray = {id(item) for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    for item in items:
        if id(item) in on_ray:
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
        elif uses_a_module_fixture(item):  # its module's tests on one worker: the fixture is built once
            item.add_marker(pytest.mark.xdist_group(f"module:{item.module.__name__}"))


def uses_a_module_fixture(item) -> bool:
    """Whether a test asks for a module-scoped fixture (a trained run, a written checkpoint) that
    xdist would build again on each worker its module's tests land on."""
    defs = getattr(item, "_fixtureinfo", None)
    return defs is not None and any(d and d[-1].scope == "module" for d in defs.name2fixturedefs.values())


@pytest.fixture
def tiny_cfg():
    """The default run config (tiny FLUX) at the suite's tiny size (``tests.helpers.TINY``), then
    ``overrides``."""
    from digenrl.config.run import load_config
    from tests.helpers import TINY

    def make(*overrides: str):
        return load_config(None, [*TINY, *overrides])

    return make


@pytest.fixture(scope="session")
def ray_cluster():
    """The suite's one Ray cluster (2 CPUs, the logical devices of ``tests.helpers.POOLS``), started
    by the first test that asks and shut down at the end of the run; yields its address. Tests that
    need Ray in this process ask for it rather than starting their own.

    Engine runs inside it keep warm workers (tests/warm.py): a run builds its workers
    in the processes a finished run kept (the same worker, the same kind) instead of starting fresh
    ones (~5 s of CPU each); a run that needs the devices kept actors hold releases them first."""
    from tests.helpers import local_ray
    from tests.warm import warm_workers

    with warm_workers():
        yield from local_ray()
