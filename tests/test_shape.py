"""The shape of app/, guarded so it holds without anyone remembering (issue 55): no class or function
over 200 lines, no import circle between modules (imports inside functions included), and the
strategy resolved from a raw config only where a run is planned (app/run/plan.py) or by a tool that
reads a config of its own."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_graph import imports_of, module_name

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"
LONGEST_DEFINITION = 200
# Tools with a `python -m` of their own that read a YAML config themselves (no run plan).
RESOLVES_ITS_OWN_CONFIG = {"app.parity", "app.parallel.strategy", "app.run.plan"}


def app_modules() -> dict[str, Path]:
    return {module_name(path): path for path in APP.rglob("*.py")}


def test_no_class_or_function_in_app_is_over_200_lines() -> None:
    too_long = []
    for path in APP.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_DEFINITION:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not too_long, f"over {LONGEST_DEFINITION} lines; split by concern: {too_long}"


def module_graph() -> dict[str, set[str]]:
    """Each app module -> the app modules it imports, at the top or inside a function; a package's
    `__init__` counts as the package."""
    modules = app_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path):
            while imported not in modules and "." in imported:  # `from app.x.y import name`: y may be a name
                imported = imported.rpartition(".")[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_between_app_modules() -> None:
    """A package imports its own modules from `__init__` (app.cli re-exports the parser): that edge is
    the package's table of contents, not a circle of ideas, so `__init__` modules are left out."""
    modules = app_modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    graph = {name: targets - packages for name, targets in module_graph().items() if name not in packages}
    assert circles(graph) == []


def test_the_strategy_is_resolved_from_a_config_only_where_a_run_is_planned() -> None:
    """Every decision that depends on the strategy reads the run plan's `strategy`; a second
    `resolve_strategy(...)` on the raw config is a place the next strategy kind must be taught."""
    callers = set()
    for name, path in app_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "resolve_strategy"
            ):
                callers.add(name)
    assert callers <= RESOLVES_ITS_OWN_CONFIG, sorted(callers - RESOLVES_ITS_OWN_CONFIG)
