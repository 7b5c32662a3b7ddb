"""No import circle inside any package.

Each package's import graph is built from its sources' syntax trees: one node per
module, one edge per import of a sibling module. Imports at module level and inside
functions count alike: a lazy import is the usual way a circle is hidden rather than
removed, and at run time the two modules still need each other. Imports under
``if TYPE_CHECKING:`` do not count: they are never executed (annotations are strings
here), so naming the type a function takes creates no dependency on its module's
code (``render`` formats a ``PlanCosts`` that ``costs`` builds and renders). A name
imported from a package's ``__init__`` counts as an import of the module that defines
it (the ``__init__`` only re-exports), so the package's facade is not a circle of its
own. Layers between packages are ``tests/test_import_layers.py``'s job.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = sorted(p for p in ROOT.glob("packages/*/src/*") if (p / "__init__.py").is_file())


def _module_name(package_dir: Path, path: Path) -> str:
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(package_dir: Path) -> dict[str, tuple[Path, ast.Module]]:
    return {
        _module_name(package_dir, path): (path, ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted(package_dir.rglob("*.py"))
    }


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if _is_package(path) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _reexports(modules: dict[str, tuple[Path, ast.Module]]) -> dict[tuple[str, str], str]:
    """(package, name) -> the module a package's ``__init__`` imports ``name`` from."""
    found: dict[tuple[str, str], str] = {}
    for module, (path, tree) in modules.items():
        if not _is_package(path):
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                for alias in node.names:
                    found[(module, alias.asname or alias.name)] = source
    return found


def _type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")
    return name == "TYPE_CHECKING"


def _executed_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if _type_checking_block(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the sibling modules it imports (anywhere in its source)."""
    modules = _sources(package_dir)
    reexports = _reexports(modules)

    def resolve(target: str, name: str | None) -> str | None:
        if name is not None and f"{target}.{name}" in modules:
            return f"{target}.{name}"
        seen: set[str] = set()
        while name is not None and (target, name) in reexports and target not in seen:
            seen.add(target)
            target = reexports[(target, name)]
            if f"{target}.{name}" in modules:
                return f"{target}.{name}"
        return target if target in modules else None

    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, (path, tree) in modules.items():
        for node in _executed_nodes(tree):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [resolve(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                targets = [resolve(source, alias.name) for alias in node.names]
            graph[module].update(t for t in targets if t is not None and t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan),
    as a path ``a -> b -> ... -> a`` through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_through(graph, component) for component in components]


def circle_report(graph: dict[str, set[str]]) -> str:
    return "; ".join(" -> ".join(circle) for circle in cycles(graph))


def _circle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle from the component's first module back to itself."""
    members = set(component)
    start = component[0]
    paths: dict[str, list[str]] = {start: [start]}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    return [*paths[node], start]
                if succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    nxt.append(succ)
        frontier = nxt
    return component


def _ids() -> Iterator[str]:
    for package_dir in PACKAGE_DIRS:
        yield package_dir.name


def test_every_package_is_found() -> None:
    assert {"fsdp_core", "multimodal_fsdp", "model_deepseek_v41"} <= set(_ids())


@pytest.mark.parametrize("package_dir", PACKAGE_DIRS, ids=list(_ids()))
def test_no_import_circle(package_dir: Path) -> None:
    graph = import_graph(package_dir)
    assert not cycles(graph), "import circles: " + circle_report(graph)


def test_the_check_finds_a_lazy_circle_and_names_it(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import A\nfrom pkg.b import B\n")
    (package / "a.py").write_text("from pkg import B\nA = 1\n")
    (package / "b.py").write_text("def f():\n    from .a import A\n    return A\nB = 2\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nimport pkg.b\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"}  # through the __init__'s re-export
    assert graph["pkg.b"] == {"pkg.a"}  # relative and lazy
    assert graph["pkg"] == {"pkg.a", "pkg.b"}
    assert graph["pkg.c"] == {"pkg.b"}  # not the annotation-only import
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
