"""The operator's modules import each other without a cycle, and only at the top of a module (a
function-level import is how the renderers once hid their cycle: render.py <-> cache.py, lws.py,
routing.py, adapters.py). import-linter's layers contract (pyproject.toml) says which way; this test
holds in `make test` too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "kubeinfer_operator"
# The CLI imports kopf's handlers only when it runs the operator (`--help` needs no kopf).
LAZY_ALLOWED = {"__main__"}


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules of the package imported at module level, those imported inside a function)."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    lazy: set[str] = set()
    top_level = set(map(id, tree.body))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level != 1:
            continue
        names = [node.module] if node.module else [alias.name for alias in node.names]
        (top if id(node) in top_level else lazy).update(n.split(".")[0] for n in names)
    return top, lazy


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.glob("*.py")):
        top, lazy = _imports(path)
        graph[path.stem] = top | lazy
    return graph


def test_no_function_level_imports_inside_the_package() -> None:
    offenders = {
        path.stem: sorted(lazy)
        for path in PACKAGE.glob("*.py")
        if (lazy := _imports(path)[1]) and path.stem not in LAZY_ALLOWED
    }
    assert not offenders, f"function-level imports (a hidden cycle?): {offenders}"


def test_the_operator_modules_form_no_import_cycle() -> None:
    graph = _graph()
    graph.pop("__init__", None)  # the package imports its handlers for `kopf run -m`
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
