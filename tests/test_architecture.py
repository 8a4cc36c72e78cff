"""The structure the docs promise (docs/architecture.md): layers that hold (no import cycle, no
import up the layer table), one driver loop, one placement derivation, the local trainer imported by
the CLI only. Fast: no Ray, no model."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from digenrl.config import PoolConfig, load_config
from digenrl.errors import UserError
from digenrl.placement import Plan, apply_plan
from digenrl.resolve import resolve
from tests.helpers import FULL_MODE

PACKAGE = Path(__file__).resolve().parents[1] / "digenrl"
LAYERS_DOC = PACKAGE.parent / "docs" / "architecture.md"


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


# ---------------------------------------------------------------------------- the import graph
def module_name(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def imported_names(tree: ast.AST, package: str) -> set[str]:
    """Every dotted name an import statement anywhere in ``tree`` (module level, in a function, under
    ``TYPE_CHECKING``) may load; ``from a import b`` names ``a`` and ``a.b`` (b may be a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package, level - 1 packages up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name resolves to its longest module prefix)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for target in imported_names(ast.parse(path.read_text(), str(path)), package):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target not in (name, root.name):  # the package's own __init__ is the foundation
                targets.add(target)
        graph[name] = targets
    return graph


@functools.cache
def _package_graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(t) for m, t in import_graph().items()}


def package_graph() -> dict[str, set[str]]:
    """This package's import graph (parsed once per test run; a fresh copy each call)."""
    return {m: set(t) for m, t in _package_graph().items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of two or more modules that import each other in a circle (mutual reachability)."""
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        reach[start] = seen
    groups = {frozenset({a} | {b for b in reach[a] if a in reach.get(b, ())}) for a in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def layer_table(doc: Path = LAYERS_DOC) -> list[tuple[str, list[str]]]:
    """The rows of the layer table in docs/architecture.md, bottom first: (layer, file patterns)."""
    section = doc.read_text().split("## 1. Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] != "layer" and set(cells[0]) != {"-"}:
            rows.append((cells[0], re.findall(r"`([^`]+\.py|[^`]+/\*?)`", cells[1])))
    return rows


def layer_of(module: str, table) -> int | None:
    """The row of ``module`` (its file or package path matched against the patterns; the most
    specific pattern wins: ``engine/scheduler.py`` over ``engine/*``)."""
    parts = module.split(".")[1:]
    files = {"/".join(parts) + ".py", "/".join(parts + ["__init__.py"])}
    best = None  # (specificity, row)
    for row, (_, patterns) in enumerate(table):
        for pattern in patterns:
            folder = pattern.removesuffix("*").removesuffix("/")
            hit = (
                pattern in files
                if pattern.endswith(".py")
                else any(f.startswith(folder + "/") for f in files)
            )
            if hit and (best is None or len(folder) > best[0]):
                best = (len(folder), row)
    return None if best is None else best[1]


def upward_imports(graph, table) -> set[tuple[str, str]]:
    return {
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if layer_of(a, table) is not None
        and layer_of(b, table) is not None
        and layer_of(b, table) > layer_of(a, table)
    }


#: (The runtime's upward edges into preflight / the planner are gone: the RunLayout, resolved once by
#: digenrl/resolve.py and handed to the runtime, replaced them.)
KNOWN_UNTIL_RUNLAYOUT: set[tuple[str, str]] = set()
#: The config's validators look up the names and defaults of what it configures: the adapter names
#: (a table in ``adapters/__init__.py``; no model code) and the sampler's default clip range.
CONFIG_LOOKUPS = {
    ("digenrl.config", "digenrl.adapters"),
    ("digenrl.config", "digenrl.algorithms.grpo"),
}
ALLOWED_UPWARD = KNOWN_UNTIL_RUNLAYOUT | CONFIG_LOOKUPS
RUNTIME = ("engine", "adapters", "distributed", "algorithms", "policy", "units", "placement")
ABOVE_THE_RUNTIME = ("planner", "preflight", "cli")


def test_every_module_is_in_a_layer():
    table = layer_table()
    assert [layer for layer, _ in table][:2] == ["foundation", "config"] and len(table) >= 10
    assert [m for m in package_graph() if layer_of(m, table) is None] == []


def test_no_import_cycles():
    graph = package_graph()
    for a, b in KNOWN_UNTIL_RUNLAYOUT:  # the one known cycle runs through these edges
        graph[a].discard(b)
    assert cycles(graph) == []


def test_no_import_runs_up_the_layer_table():
    graph, table = package_graph(), layer_table()
    up = upward_imports(graph, table)
    assert up - ALLOWED_UPWARD == set()
    assert ALLOWED_UPWARD - up == set()  # an allowed edge that is gone: remove it from the list


def in_part(module: str, parts: tuple[str, ...]) -> bool:
    return any(module == f"digenrl.{p}" or module.startswith(f"digenrl.{p}.") for p in parts)


def test_the_runtime_never_imports_the_planner_preflight_or_the_cli():
    graph = package_graph()
    edges = {(a, b) for a in graph for b in graph[a] if in_part(a, RUNTIME) and in_part(b, ABOVE_THE_RUNTIME)}
    assert edges - KNOWN_UNTIL_RUNLAYOUT == set()


def test_the_checker_sees_a_planted_cycle_and_an_upward_import(tmp_path):
    """The rules can fail: a package with a function-level cycle and an import up its table."""
    pkg = tmp_path / "digenrl"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def f():\n    from digenrl.engine import runtime\n")
    (pkg / "engine" / "runtime.py").write_text("from .. import config\nfrom digenrl.planner import x\n")
    (pkg / "planner.py").write_text("")
    doc = tmp_path / "a.md"
    doc.write_text(
        "## 1. Layers\n| layer | files | knows about |\n|---|---|---|\n"
        "| config | `config.py` | - |\n| drivers | `engine/*` | - |\n| planner | `planner.py` | - |\n"
    )
    graph, table = import_graph(pkg), layer_table(doc)
    assert cycles(graph) == [["digenrl.config", "digenrl.engine.runtime"]]
    assert upward_imports(graph, table) == {
        ("digenrl.config", "digenrl.engine"),  # the package's __init__ runs first
        ("digenrl.config", "digenrl.engine.runtime"),
        ("digenrl.engine.runtime", "digenrl.planner"),
    }
    assert layer_of("digenrl.engine", table) == 1 and layer_of("digenrl", table) is None


# ---------------------------------------------------------------------------- the rest
def test_only_the_cli_imports_the_local_trainer():
    importers = set()
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "digenrl.trainer":
                importers.add(name)
            elif isinstance(node, ast.Import) and any(a.name == "digenrl.trainer" for a in node.names):
                importers.add(name)
    assert importers and all(name.startswith("cli/") for name in importers), importers


def test_the_scheduler_is_asked_in_one_loop():
    """Only the driver loop hands out units (the runtime and the simulator run it)."""
    callers = {
        name
        for name, tree in modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("next_unit", "requeue", "release")
        and isinstance(node.ctx, ast.Load)
        and name != "engine/scheduler.py"
    }
    assert callers == {"engine/driver.py"}


DISAGG = [
    *FULL_MODE,
    "engine.tsp_degree=2",
    "engine.tag=false",
    "engine.max_staleness=1",
    "cluster.pools=[{name: r, device: H20, count: 3}, {name: t, device: H800, count: 2}]",
    "placement.rollout_pool=r",
    "placement.trainer_pool=t",
]


def test_a_run_config_and_its_plan_map_both_ways():
    cfg = load_config(None, DISAGG + ["train.device=cuda"])
    plan = Plan.from_run_config(cfg)
    assert [p.name for p in plan.pools] == ["r", "t"] and plan.ranks == 2
    assert [(w.name, w.role, w.pool.name) for w in plan.workers()] == [
        ("r0", "rollout", "r"),
        ("r1", "rollout", "r"),
        ("r2", "rollout", "r"),
        ("t0", "trainer", "t"),
        ("t1", "trainer", "t"),
    ]
    assert resolve(cfg).workers == plan.workers()  # the runtime's workers are the plan's
    back = apply_plan(cfg, plan, "cuda")
    for section in ("cluster", "placement", "engine", "train"):
        assert getattr(back, section) == getattr(cfg, section), section
    sched = plan.scheduler_config(cfg.train.prompts_per_iteration, 3)
    assert (sched.placement, sched.tsp_degree, sched.tag, sched.max_staleness) == (
        "disaggregated",
        2,
        False,
        1,
    )


def test_colocated_plan_uses_every_pool_in_both_roles():
    cfg = load_config(None, ["placement.mode=colocated"])
    plan = Plan.from_run_config(cfg)
    assert {w.role for w in plan.workers()} == {"both"} and plan.ranks == len(cfg.cluster.pools)
    assert apply_plan(cfg, plan, "cpu").cluster == cfg.cluster


def test_gpu_names_no_device_type_once_for_the_planner():
    from digenrl.planner.gpus import cluster_from_run_config

    cfg = load_config(
        None,
        [*FULL_MODE, "cluster.pools=[{name: rollout, device: gpu}, {name: trainer, device: H100}]"],
    )
    with pytest.raises(UserError, match="'gpu', which names no GPU type") as a:
        Plan.from_run_config(cfg).typed()
    with pytest.raises(UserError) as b:
        cluster_from_run_config(cfg)
    assert str(a.value) == str(b.value)
    assert Plan.from_run_config(cfg).workers()[0].pool.device == "gpu"  # the runtime takes any GPU


def test_a_pool_is_one_type_in_configs_cluster_files_and_plans():
    from digenrl.planner.gpus import cluster_from_dict

    cluster = cluster_from_dict({"pools": [{"name": "a", "device": "h800", "count": 2}]})
    assert cluster.pools == [PoolConfig(name="a", device="H800", count=2)]  # canonical spelling
    with pytest.raises(UserError, match=r"cluster: pools.0.device: unknown device type 'B200'"):
        cluster_from_dict({"pools": [{"name": "a", "device": "B200", "count": 1}]})
    with pytest.raises(ValueError, match="two pools of different names"):
        Plan(placement="disaggregated", pools=(cluster.pools[0], cluster.pools[0]))
