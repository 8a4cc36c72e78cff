"""How the suite itself runs (tests/conftest.py): under ``./dev.sh test`` (pytest-xdist, ``--dist
loadgroup``) the tests on the suite's Ray cluster, the ``faults`` tests among them, are one group,
run in order by one worker on one cluster, so engine runs keep warm workers.
pytest-xdist 3.8 on pytest 9 dropped the groups without a word (each worker then started its own
cluster and actors: the suite took 1098 CPU-seconds and 577-604 s, against 965 and 511 s as one
group); this test fails when that happens again."""

from __future__ import annotations

import pytest
from conftest import RAY_GROUP


def test_the_tests_on_the_ray_cluster_run_as_one_xdist_group(request, ray_cluster):
    (mark,) = list(request.node.iter_markers("xdist_group"))
    assert mark.args == (RAY_GROUP,) == ("ray_cluster",)
    if getattr(request.config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        assert request.node.nodeid.endswith("@ray_cluster"), (
            "pytest-xdist did not apply the group (pytest and pytest-xdist versions: see pyproject.toml)"
        )


@pytest.mark.faults
def test_the_fault_tests_run_in_the_same_group(request, ray_cluster):
    """The ``faults`` tests share the group and its cluster: a group of their own on the other worker
    cost a second cluster and a second pool of actors (tests/conftest.py)."""
    (mark,) = list(request.node.iter_markers("xdist_group"))
    assert mark.args == (RAY_GROUP,)
