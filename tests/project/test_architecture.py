"""The shape of the house: imports run one way, and the library never loads the CLI's stack.

Imports are read with ``ast``, at module level and inside functions alike: a function-
level import is still a dependency (it only defers a heavy load, such as pandas until a
report is built), and a cycle through one means two modules that each know the other.
Imports under ``if TYPE_CHECKING:`` never run and are left out: annotations may name a
class of a module that depends on this one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fpaudit"
# Only the commands and the renderers may import typer or rich (STYLE.md: "Only cli and render
# import typer or rich").
# A renderer is cli/render.py or a command's own cli/render_CMD.py: by its name.
RENDERERS = {f"fpaudit.cli.{p.stem}" for p in (PACKAGE / "cli").glob("render*.py")}
PRESENTATION = {
    "fpaudit.cli.commands",
    "fpaudit.cli.commands_report",
    "fpaudit.cli.commands_run",
    "fpaudit.cli.common",
    "fpaudit.cli.formatters",  # picks a renderer (or JSON) per result
    *RENDERERS,
    "fpaudit.__main__",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(name: str, annotations: bool = False) -> set[str]:
    """The fpaudit modules ``name`` imports when it runs (not under TYPE_CHECKING), or
    with ``annotations`` also those it names for the type checker only."""
    tree = ast.parse(MODULES[name].read_text())
    found: set[str] = set()
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and is_type_checking(node) and not annotations:
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in found if m in MODULES and m != name}


def test_the_import_graph_reads_itself() -> None:
    # a known edge each way of writing an import, so the parser is not vacuous
    assert "fpaudit.report.records" in imported(
        "fpaudit.report.store"
    )  # from fpaudit.report.records import (...)
    assert "fpaudit.rules.analysis" in imported(
        "fpaudit.rules.gating"
    )  # from fpaudit import analysis
    assert "fpaudit.report.store" in imported("fpaudit.capture.audit")  # inside build_report
    assert "fpaudit.report.store" not in imported("fpaudit.cli.render")  # only under TYPE_CHECKING


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` meets (empty: the graph is acyclic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for child in sorted(graph[name]):
            if state.get(child) == 1:
                cycles.append([*path[path.index(child) :], child])
            elif child not in state:
                visit(child)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return cycles


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    graph = {name: imported(name, annotations) for name in MODULES if name != "fpaudit"}
    # The package's __init__ re-exports the public API lazily; every module imports
    # it implicitly, so it is not an edge of the graph.
    for edges in graph.values():
        edges.discard("fpaudit")
    return graph


def test_no_import_cycle_among_fpaudit_modules() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_two_capture_modules_know_each_other_even_for_the_type_checker() -> None:
    """Inside ``capture/``, an annotation import is a dependency too: two modules that
    name each other's classes are one design split across two files (the mode, the
    engine wrapper and the optimizer hooks share the audit's ``CaptureContext``)."""
    graph = {
        name: {t for t in edges if t.startswith("fpaudit.capture.")}
        for name, edges in import_graph(annotations=True).items()
        if name.startswith("fpaudit.capture.")
    }
    assert "fpaudit.capture.context" in graph["fpaudit.capture.mode"]  # an annotation import
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in capture/: " + "; ".join(" -> ".join(c) for c in cycles)


# The rooms, lowest first: a module imports modules of its own room or of rooms below it
# (docs/architecture.md draws them). "fpaudit" is the package's top level: the base every
# room may use (errors, text, defaults, the private-torch seam, signal handling).
LAYERS = (
    "fpaudit",
    "numerics",
    "report",
    "kernels",
    "rules",
    "capture",
    "run",
    "integrations",
    "cli",
    "__main__",
)


def room(module: str) -> str:
    """``fpaudit.rules.gating`` -> ``rules``; a top-level module -> ``fpaudit``."""
    parts = module.split(".")
    if len(parts) == 2 and MODULES[module].name != "__init__.py" and parts[1] != "__main__":
        return "fpaudit"
    return parts[1] if len(parts) > 1 else "fpaudit"


def layer(module: str) -> int:
    name = room(module)
    assert name in LAYERS, f"{module} is in no declared room ({name}): declare it in LAYERS"
    return LAYERS.index(name)


def test_every_module_is_in_a_declared_room() -> None:
    for module in MODULES:
        layer(module)
    assert room("fpaudit.errors") == "fpaudit" and room("fpaudit.rules.gating") == "rules"
    assert layer("fpaudit.numerics.formats") < layer("fpaudit.cli.commands")


@pytest.mark.parametrize("annotations", [False, True], ids=["run", "annotations"])
def test_imports_run_down_the_rooms(annotations: bool) -> None:
    """Also an annotation import: a lower room naming a higher room's class for the type
    checker is a cycle between rooms all the same (the data model would know a kernel).
    The package's ``__init__`` is the public API: it names every room's classes for the
    type checker and loads them lazily."""
    upward = [
        f"{module} -> {target}"
        for module in sorted(set(MODULES) - {"fpaudit"})
        for target in sorted(imported(module, annotations))
        if target != "fpaudit" and layer(target) > layer(module)
    ]
    assert upward == [], "imports up the rooms: " + ", ".join(upward)


# What reads and writes report files: the rules take the data (fpaudit.report.data's
# ReportData, its tables named in fpaudit.report.tables), never these.
REPORT_IO = {
    "fpaudit.report.store",
    "fpaudit.report.files",
    "fpaudit.report.checks",
    "fpaudit.report.outputs",
}


@pytest.mark.parametrize("annotations", [False, True], ids=["run", "annotations"])
def test_no_rule_imports_the_report_io(annotations: bool) -> None:
    """The rules are pure functions over a report's data: a rules module importing the
    report's I/O (Parquet files, locks, staging), even for the type checker, fails."""
    rules = [module for module in MODULES if room(module) == "rules"]
    assert len(rules) > 10  # the room is found
    reaching = {
        f"{module} -> {target}"
        for module in rules
        for target in imported(module, annotations) & REPORT_IO
    }
    assert not reaching, "rules reading or writing report files: " + ", ".join(sorted(reaching))
    # and the check sees such an import where there is one
    assert "fpaudit.report.store" in imported("fpaudit.run.training")


LIBRARY = sorted(set(MODULES) - PRESENTATION)
# The framework an integration plugs into is the user's, with its own imports
# (Lightning loads rich for its progress bars): it is imported first, and the module
# must load nothing of typer or rich beyond what the framework already had.
FRAMEWORK = {"fpaudit.integrations.lightning": "lightning.pytorch"}


# One process imports what the library may load (torch, numpy, pandas, pyarrow) and then
# forks a child per module: each child starts from that state, so what a module loads
# on top is its own, at the cost of one torch start-up instead of one per module.
_FORKING_CHECK = """
import json, os, sys
import numpy, pandas, pyarrow, pyarrow.parquet, torch
def cli_stack():
    return sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'typer'))
assert not cli_stack(), cli_stack()  # the allowed stack itself loads neither
found = {}
for module, framework in json.loads(sys.argv[1]):
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        try:
            if framework:
                __import__(framework)
            before = set(cli_stack())
            __import__(module)
            answer = sorted(set(cli_stack()) - before)
        except BaseException as error:
            answer = f"import failed: {type(error).__name__}: {error}"
        os.write(write, json.dumps(answer).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        found[module] = json.loads(pipe.read() or '"no answer"')
    os.wait()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def cli_stack_loaded() -> dict[str, object]:
    """What each library module loads of typer and rich (a list), or why it failed."""
    import json

    wanted = [(m, FRAMEWORK.get(m)) for m in LIBRARY]
    result = subprocess.run(
        [sys.executable, "-c", _FORKING_CHECK, json.dumps(wanted)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    found: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("module", LIBRARY)
def test_library_module_loads_without_typer_or_rich(
    module: str, cli_stack_loaded: dict[str, object]
) -> None:
    framework = FRAMEWORK.get(module)
    if framework is not None:
        pytest.importorskip(framework)
    assert cli_stack_loaded[module] == [], cli_stack_loaded[module]


def test_the_forking_check_sees_a_module_that_loads_rich(tmp_path: Path) -> None:
    """The check above can fail: a module importing rich is reported, with what it loaded."""
    import json

    (tmp_path / "loads_rich.py").write_text("import rich.console\n")
    (tmp_path / "plain.py").write_text("import json\n")
    result = subprocess.run(
        [sys.executable, "-c", _FORKING_CHECK,
         json.dumps([["loads_rich", None], ["plain", None], ["missing_module", None]])],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert "rich" in found["loads_rich"] and "rich.console" in found["loads_rich"]
    assert found["plain"] == []
    assert found["missing_module"].startswith("import failed: ModuleNotFoundError")


def test_each_public_name_is_declared_where_it_lives_and_typed_as_it_loads() -> None:
    """``fpaudit/__init__.py`` declares a public name once, in ``_WHERE`` (name → module);
    ``__all__`` is derived from it and the ``TYPE_CHECKING`` imports repeat it for mypy.
    The two must agree name for name and module for module, or mypy and the lazy loader
    would see different packages."""
    import fpaudit

    tree = ast.parse(MODULES["fpaudit"].read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and is_type_checking(node):
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
                for alias in statement.names:
                    assert alias.asname == alias.name, f"{ast.unparse(statement)}: X as X"
                    typed[alias.name] = str(statement.module).removeprefix("fpaudit.")
    where = fpaudit._WHERE
    assert typed == where
    # every name but the one that would shadow a builtin under `from fpaudit import *`
    assert fpaudit.__all__ == sorted(set(where) - {"compile"} | {"__version__"})
    assert "compile" in dir(fpaudit) and fpaudit.compile.__module__ == "fpaudit.capture.compiled"
    namespace: dict[str, object] = {}
    exec("from fpaudit import *", namespace)
    assert "compile" not in namespace and "audit" in namespace
    for name, module in where.items():  # each loads from the module it names
        assert getattr(fpaudit, name) is getattr(
            __import__(f"fpaudit.{module}", fromlist=["_"]), name
        )


# tests/ follows fpaudit/: a folder per room of the package, plus project/ for the whole
# product; tests of the top level (the seam, errors, signals) stay in tests/ itself.
TEST_ROOMS = {name for name in LAYERS if (PACKAGE / name).is_dir()} | {"project"}


def test_every_test_file_sits_in_a_room_folder() -> None:
    """The convention, not a hand-kept list: each ``test_*.py`` is in ``tests/`` or in a
    folder named for a room of ``fpaudit/`` (or ``project/``), one level down, and each
    room folder is a package (its tests import helpers as ``..conftest``). A new test file
    in a room folder needs no line anywhere else."""
    tests = Path(__file__).resolve().parents[1]
    misplaced = sorted(
        p.relative_to(tests).as_posix()
        for p in tests.rglob("test_*.py")
        if p.parent != tests and (p.parent.parent != tests or p.parent.name not in TEST_ROOMS)
    )
    assert misplaced == [], f"test files outside the room folders {sorted(TEST_ROOMS)}"
    assert {"capture", "rules", "cli", "project"} <= TEST_ROOMS  # the rooms were found
    for name in TEST_ROOMS:
        assert (tests / name / "__init__.py").is_file(), f"tests/{name}/ is not a package"
    top = {p.name for p in tests.glob("test_*.py")}
    assert "test_torch_seam.py" in top  # the top level's own tests stay in tests/
