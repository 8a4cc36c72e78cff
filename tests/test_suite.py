"""How the suite itself runs (tests/conftest.py): under ``./dev.sh test`` (pytest-xdist, ``--dist
loadgroup``) the tests on the suite's Ray cluster are two groups (the ``faults`` tests and the
rest), each run in order by one worker on one cluster, so engine runs keep warm workers.
pytest-xdist 3.8 on pytest 9 dropped the groups without a word (each worker then started its own
cluster and actors: the suite took 1098 CPU-seconds and 577-604 s, against 965 and 511 s as one
group); this test fails when that happens again."""

from __future__ import annotations

from conftest import ray_group


def test_the_tests_on_the_ray_cluster_run_as_one_xdist_group(request, ray_cluster):
    (mark,) = list(request.node.iter_markers("xdist_group"))
    assert mark.args == (ray_group(faults=False),) == ("ray_cluster",)
    if getattr(request.config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        assert request.node.nodeid.endswith("@ray_cluster"), (
            "pytest-xdist did not apply the group (pytest and pytest-xdist versions: see pyproject.toml)"
        )
