"""The structure the docs promise (docs/architecture.md): layers that hold (no import cycle, no
import up the layer table), one driver loop, one placement derivation, the local trainer imported by
the CLI only. Fast: no Ray, no model."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from digenrl.config.engine import PoolConfig
from digenrl.config.run import load_config
from digenrl.errors import UserError
from digenrl.placement.plan import Plan, apply_plan
from digenrl.placement.resolve import resolve
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


def import_nodes(tree: ast.AST, module_level: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``: all of them, or only those that run when the module is
    imported (``module_level``: not in a function body, not under ``if TYPE_CHECKING``)."""
    if not module_level:
        return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    found, todo = [], list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def imported_names(nodes, package: str) -> set[str]:
    """Every dotted name the import statements ``nodes`` may load; ``from a import b`` names ``a``
    and ``a.b`` (b may be a module)."""
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        else:
            base = node.module or ""
            if node.level:  # relative: from the importing module's package, level - 1 packages up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def package_files(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def in_package(names: set[str], files: dict[str, Path], skip=()) -> set[str]:
    """The package's modules among dotted ``names`` (each resolves to its longest module prefix)."""
    targets = set()
    for target in names:
        while target and target not in files:
            target = target.rpartition(".")[0]
        if target and target not in skip:
            targets.add(target)
    return targets


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere (module level, in a function, for typing)."""
    files = package_files(root)
    return {
        name: in_package(
            imported_names(import_nodes(ast.parse(path.read_text(), str(path))), package_of(name, path)),
            files,
            skip=(name, root.name),  # the package's own __init__ is the foundation
        )
        for name, path in files.items()
    }


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


#: Third-party packages whose import costs seconds: a function-level import is for deferring these.
HEAVY = frozenset({"torch", "diffusers", "transformers", "peft", "ray", "accelerate"})


def with_parents(modules: set[str]) -> set[str]:
    """Importing ``a.b.c`` runs ``a.b`` first."""
    return modules | {".".join(m.split(".")[:i]) for m in modules for i in range(2, len(m.split(".")))}


def heavy_loads(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the heavy packages that importing it loads (module-level imports, followed through
    the package)."""
    files = package_files(root)
    edges, heavy = {}, {}
    for name, path in files.items():
        names = imported_names(
            import_nodes(ast.parse(path.read_text()), module_level=True), package_of(name, path)
        )
        heavy[name] = {n.split(".")[0] for n in names} & HEAVY
        edges[name] = with_parents(in_package(names, files, skip=(name,)))
    loads = {}
    for start in files:
        seen, todo = {start}, list(edges[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(edges[m])
        loads[start] = set().union(*(heavy[m] for m in seen))
    return loads


def needless_function_imports(root: Path = PACKAGE) -> list[str]:
    """The package's own modules imported inside a function although importing them at the top
    would load no heavy package the importing module does not load already. The CLI is exempt: each
    command imports what it runs, which keeps ``digenrl --help`` at ~0.09 s (~0.3 s with every
    command's modules at the top)."""
    files, loads = package_files(root), heavy_loads(root)
    found = []
    for name, path in files.items():
        if name.startswith(f"{root.name}.cli."):
            continue
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for imp in import_nodes(func):  # (a nested function's imports are seen twice: a set)
                names = imported_names([imp], package_of(name, path))
                targets = with_parents(in_package(names, files, skip=(name, root.name)))
                if targets and not set().union(*(loads[t] for t in targets)) - loads[name]:
                    found.append(f"{path.relative_to(root.parent)}:{imp.lineno} {sorted(targets)}")
    return sorted(set(found))


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


#: The config's validators look up the names and defaults of what it configures: the adapter names
#: (a table in ``adapters/__init__.py``; no model code) and the sampler's default clip range.
CONFIG_LOOKUPS = {
    ("digenrl.config.model", "digenrl.adapters"),
    ("digenrl.config.run", "digenrl.algorithms.grpo"),
}
ALLOWED_UPWARD = CONFIG_LOOKUPS
RUNTIME = (
    "engine",
    "adapters",
    "distributed",
    "algorithms",
    "policy",
    "checkpoint",
    "units",
    "schedule",
    "run",
    "placement.plan",
    "placement.layout",
    "placement.devices",
)
ABOVE_THE_RUNTIME = ("planner", "placement.preflight", "placement.resolve", "launch", "cli")


def test_every_module_is_in_a_layer():
    table = layer_table()
    assert [layer for layer, _ in table][:2] == ["foundation", "config"] and len(table) >= 10
    assert [m for m in package_graph() if layer_of(m, table) is None] == []


def test_no_import_cycles():
    assert cycles(package_graph()) == []


def test_no_import_runs_up_the_layer_table():
    graph, table = package_graph(), layer_table()
    up = upward_imports(graph, table)
    assert up - ALLOWED_UPWARD == set()
    assert ALLOWED_UPWARD - up == set()  # an allowed edge that is gone: remove it from the list


def in_part(module: str, parts: tuple[str, ...]) -> bool:
    return any(module == f"digenrl.{p}" or module.startswith(f"digenrl.{p}.") for p in parts)


def test_function_level_imports_only_defer_a_heavy_import():
    assert needless_function_imports() == []


def test_the_runtime_never_imports_the_planner_preflight_or_the_cli():
    graph = package_graph()
    edges = {(a, b) for a in graph for b in graph[a] if in_part(a, RUNTIME) and in_part(b, ABOVE_THE_RUNTIME)}
    assert edges == set()


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


def test_the_checker_sees_a_function_level_import_that_defers_nothing(tmp_path):
    pkg = tmp_path / "digenrl"
    (pkg / "cli").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "cli/__init__.py": "",
        "light.py": "",
        "model.py": "import torch\n",
        "model_user.py": "from digenrl import light\nfrom digenrl.model import m\n",  # torch, one down
        "runner.py": (
            "def a():\n    from digenrl import light\n"  # loads nothing heavy: belongs at the top
            "def b():\n    from digenrl.model_user import x\n"  # defers torch: fine
            "def c():\n    import digenrl.model\n"  # defers torch: fine
        ),
        "cli/app.py": "def a():\n    from digenrl import light\n",  # a CLI command may
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert heavy_loads(pkg)["digenrl.model_user"] == {"torch"}
    assert needless_function_imports(pkg) == ["digenrl/runner.py:2 ['digenrl.light']"]


# ---------------------------------------------------------------------------- the rest
def test_only_the_cli_imports_the_local_trainer():
    importers = set()
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "digenrl.engine.local":
                importers.add(name)
            elif isinstance(node, ast.Import) and any(a.name == "digenrl.engine.local" for a in node.names):
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
        and name != "schedule/scheduler.py"
    }
    assert callers == {"schedule/driver.py"}


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


def train_path(doc: Path = LAYERS_DOC) -> list[tuple[str, str]]:
    """docs/architecture.md's numbered path of ``digenrl train``: (file under digenrl/, qualified name)."""
    section = doc.read_text().split("<!-- train-path -->", 1)[1].split("<!-- /train-path -->", 1)[0]
    return re.findall(r"^\d+\. `([\w/]+\.py): ([\w.]+)`", section, re.M)


def defines(path: Path, qualname: str) -> bool:
    """Whether the module at ``path`` defines ``qualname`` (a function, or a class's method)."""
    scope = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        node = next((n for n in scope if getattr(n, "name", None) == part), None)
        if node is None:
            return False
        scope = getattr(node, "body", [])
    return True


def test_the_documented_path_of_train_is_the_code():
    """Every function the newcomer's path names exists where the list says; the path stays short."""
    path = train_path()
    assert 10 <= len(path) <= 20
    missing = [f"{f}: {q}" for f, q in path if not (PACKAGE / f).exists() or not defines(PACKAGE / f, q)]
    assert missing == []


def test_the_path_checker_sees_a_function_that_moved(tmp_path):
    doc = tmp_path / "a.md"
    items = "1. `launch.py: run_engine` -- x\n2. `launch.py: gone` -- y\n"
    doc.write_text(f"<!-- train-path -->\n{items}<!-- /train-path -->")
    (f, q1), (_, q2) = train_path(doc)
    assert defines(PACKAGE / f, q1) and not defines(PACKAGE / f, q2)
