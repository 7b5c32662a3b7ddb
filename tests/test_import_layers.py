"""Layers never look up: no module of a lower package imports an upper package.

fsdp-core is the base, multimodal-fsdp builds on it, model packages build on both.
What a package may import is read from its own declared dependencies
(``pyproject.toml``), so a new model package is checked without editing this test,
and the check reads the sources (every ``import``, ``from ... import``, and
``importlib.import_module`` / ``__import__`` with a literal name), so a lazy import
inside a function counts too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import monorepo  # noqa: E402

PACKAGES = monorepo.packages()
IMPORT_NAMES = {name: package.import_name for name, package in PACKAGES.items()}


def imported_modules(source: str) -> set[str]:
    """Top-level names of every module ``source`` imports (statically visible)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if name in ("import_module", "__import__") and literal:
                found.add(str(first.value).split(".")[0])  # type: ignore[attr-defined]
    return found


def forbidden_imports(package: str) -> dict[str, set[str]]:
    """Per source file of ``package``: sibling packages it imports but does not declare."""
    allowed = {package, *monorepo.sibling_closure(package, PACKAGES)}
    others = {IMPORT_NAMES[name] for name in PACKAGES if name not in allowed}
    problems: dict[str, set[str]] = {}
    source_root = PACKAGES[package].directory / "src"
    for path in sorted(source_root.rglob("*.py")):
        bad = imported_modules(path.read_text(encoding="utf-8")) & others
        if bad:
            problems[str(path.relative_to(ROOT))] = bad
    return problems


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_imports_an_upper_package(package: str) -> None:
    problems = forbidden_imports(package)
    assert not problems, f"{package} imports packages above it: {problems}"


def test_the_layers_are_what_the_design_says() -> None:
    assert monorepo.sibling_closure("fsdp-core", PACKAGES) == []
    assert monorepo.sibling_closure("multimodal-fsdp", PACKAGES) == ["fsdp-core"]
    assert set(monorepo.sibling_closure("model-deepseek-v41", PACKAGES)) == {
        "fsdp-core",
        "multimodal-fsdp",
    }


def test_the_check_sees_every_kind_of_import() -> None:
    source = (
        "import model_deepseek_v41\n"
        "from multimodal_fsdp.estimate.costs import plan_costs\n"
        "def lazy():\n"
        "    import importlib\n"
        "    return importlib.import_module('other_pkg.sub'), __import__('third')\n"
        "from . import sibling\n"
    )
    assert imported_modules(source) == {
        "model_deepseek_v41",
        "multimodal_fsdp",
        "importlib",
        "other_pkg",
        "third",
    }
