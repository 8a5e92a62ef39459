"""Sizes a reader can hold: no module over 800 lines, no class over 300, no function over
80 (issue 23). GPU kernel bodies (``@triton.jit``) are exempt: a kernel is one loop nest
whose parts cannot be calls. The ones still over are listed with their size today: the
list only shrinks (a listed one that grows, or one that is mended and still listed,
fails), so the next change to each of them is the one that splits it."""

from __future__ import annotations

import ast

from ..conftest import ROOT

MODULE_LINES, CLASS_LINES, FUNCTION_LINES = 800, 300, 80


def _is_kernel(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("triton.jit") for d in node.decorator_list)


def over(source: str, name: str) -> dict[str, tuple[int, int]]:
    """The module ``name`` and its classes and functions that are over their limits:
    (size, limit), functions named ``module::Class.method``."""
    found: dict[str, tuple[int, int]] = {}
    lines = len(source.splitlines())
    if lines > MODULE_LINES:
        found[name] = (lines, MODULE_LINES)
    stack: list[tuple[ast.AST, str]] = [(ast.parse(source), "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                stack.append((child, prefix))
                continue
            size = (child.end_lineno or child.lineno) - child.lineno + 1
            limit = CLASS_LINES if isinstance(child, ast.ClassDef) else FUNCTION_LINES
            kernel = isinstance(child, ast.FunctionDef) and _is_kernel(child)
            if size > limit and not kernel:
                found[f"{name}::{prefix}{child.name}"] = (size, limit)
            stack.append((child, f"{prefix}{child.name}."))
    return found


def measured() -> dict[str, tuple[int, int]]:
    found: dict[str, tuple[int, int]] = {}
    for path in sorted((ROOT / "fpaudit").rglob("*.py")):
        found.update(over(path.read_text(), path.relative_to(ROOT).as_posix()))
    return found


def test_nothing_is_over_its_size() -> None:
    # no list of exceptions: a module, class or function over its limit is split
    found = measured()
    assert not found, f"over the limit (size, limit): {found}"


def test_the_measure_sees_a_long_method_and_skips_a_kernel() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(FUNCTION_LINES))  # 80 + def = 81
    source = f"@triton.jit\ndef k():\n{body}\n\nclass C:\n    def f(self):\n{body}\n"
    assert over(source, "m.py") == {"m.py::C.f": (FUNCTION_LINES + 1, FUNCTION_LINES)}
    short = "\n".join(f"        x{i} = {i}" for i in range(FUNCTION_LINES - 1))
    assert over(f"class C:\n    def f(self):\n{short}\n", "m.py") == {}
