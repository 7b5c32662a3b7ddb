"""multimodal_fsdp is grouped by its seams, and the groups form layers.

From the bottom: ``discovery`` (reads the module tree) and ``balance`` (the media
exchange), then ``runtime`` (hooks that run during steps; the ``balance_media`` hook runs
the exchange), then the planning modules at the top level (the policy, the parts, the
parallelizer), then ``estimate`` (what a plan costs), ``measure`` (one real step,
compared with the estimates) and ``cli``. A module imports only from its own group and
the groups below it, and never a private (underscore) name of a module in another group:
a group's private names are its own business. Imports under ``if TYPE_CHECKING:`` do not
count (they never run). Everything is read from the syntax trees, so lazy imports inside
functions count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "packages" / "multimodal-fsdp" / "src" / "multimodal_fsdp"

#: Group of each sub-package; modules directly in multimodal_fsdp form "planning".
#: A group may import the groups with a lower number and its own.
LEVELS = {
    "discovery": 0,
    "balance": 0,
    "runtime": 1,
    "planning": 2,
    "estimate": 3,
    "measure": 4,
    "cli": 5,
}
FACADES = {"__init__", "__main__"}  # re-export the public names; above everything


def _group(module: str) -> str:
    """``multimodal_fsdp.estimate.costs`` -> ``estimate``; top-level modules -> planning."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LEVELS:
        return parts[1]
    return "planning"


def _module_of(path: Path) -> str:
    parts = ["multimodal_fsdp", *path.relative_to(SOURCE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """``(module, imported names)`` of every import that runs (not TYPE_CHECKING ones)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def _violations() -> tuple[list[str], list[str]]:
    upward: list[str] = []
    private: list[str] = []
    for path in sorted(SOURCE.rglob("*.py")):
        module = _module_of(path)
        if path.stem in FACADES and path.parent == SOURCE:
            continue
        group = _group(module)
        for target, names in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if not target.startswith("multimodal_fsdp.") or target == "multimodal_fsdp":
                continue
            other = _group(target)
            if LEVELS[other] > LEVELS[group] or (LEVELS[other] == LEVELS[group] and other != group):
                upward.append(f"{module} ({group}) imports {target} ({other})")
            if other != group:
                hidden = [n for n in names if n.startswith("_")]
                if hidden:
                    private.append(f"{module} imports {hidden} from {target}")
    return upward, private


def test_groups_import_only_their_own_and_lower_groups() -> None:
    upward, _ = _violations()
    assert not upward, "imports against the group layers:\n" + "\n".join(upward)


def test_no_private_name_crosses_a_group() -> None:
    _, private = _violations()
    assert not private, "private names imported across groups:\n" + "\n".join(private)


@pytest.mark.parametrize(
    ("module", "group"),
    [
        ("multimodal_fsdp.discovery.walk", "discovery"),
        ("multimodal_fsdp.parallelizer", "planning"),
        ("multimodal_fsdp.estimate.costs", "estimate"),
        ("multimodal_fsdp.cli.main", "cli"),
    ],
)
def test_group_of_a_module(module: str, group: str) -> None:
    assert _group(module) == group


def test_an_upward_import_is_reported(tmp_path: Path) -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from multimodal_fsdp.estimate.costs import _hidden\n"
        "if TYPE_CHECKING:\n"
        "    from multimodal_fsdp.cli.main import main\n"
    )
    found = _runtime_imports(tree)
    assert ("multimodal_fsdp.estimate.costs", ["_hidden"]) in found
    assert all(target != "multimodal_fsdp.cli.main" for target, _ in found)


#: Groups whose modules take plans: they read what ``plan()`` recorded and never ask the
#: parallelizer again, so none imports it (only the CLI, the application layer, builds one).
PLAN_READERS = ("estimate", "measure")
PARALLELIZER = "multimodal_fsdp.parallelizer"


def _parallelizer_importers() -> list[str]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        module = _module_of(path)
        if _group(module) not in PLAN_READERS and module != "multimodal_fsdp.cli.inspection":
            continue
        targets = _runtime_imports(ast.parse(path.read_text(encoding="utf-8")))
        if any(target == PARALLELIZER for target, _ in targets):
            found.append(module)
    return found


def test_no_estimate_or_measure_module_imports_the_parallelizer() -> None:
    """Costs, memory, activations, the chooser, the measurements and ``inspect_model``
    take ``(plan, model)``: the parallelizer is imported for type checking at most."""
    found = _parallelizer_importers()
    assert not found, "modules that import the parallelizer at run time: " + ", ".join(found)


#: The estimates read a plan and its hooks' cost models (``RuntimeHook.collectives``):
#: no estimate module imports the hooks' own modules.
RUNTIME = "multimodal_fsdp.runtime"


def _estimate_runtime_imports() -> list[str]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        module = _module_of(path)
        if _group(module) != "estimate":
            continue
        for target, _ in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if target == RUNTIME or target.startswith(f"{RUNTIME}."):
                found.append(f"{module} imports {target}")
    return found


def test_no_estimate_module_imports_a_runtime_module() -> None:
    """Each runtime hook owns its cost model; ``plan_costs`` asks the planned hook objects
    (a hand-built entry is rebuilt by ``multimodal_fsdp.media_hook_planning``)."""
    found = _estimate_runtime_imports()
    assert not found, "estimate modules that import runtime hooks:\n" + "\n".join(found)


def test_costs_and_memory_do_not_import_each_other() -> None:
    """``PlanCosts`` holds a memory estimate and the memory estimate reads a plan's
    parameter figures: neither module imports the other at run time."""
    pairs = {
        "multimodal_fsdp.estimate.costs": "multimodal_fsdp.estimate.memory",
        "multimodal_fsdp.estimate.memory": "multimodal_fsdp.estimate.costs",
    }
    found = []
    for module, other in pairs.items():
        path = SOURCE / Path(*module.split(".")[1:]).with_suffix(".py")
        targets = _runtime_imports(ast.parse(path.read_text(encoding="utf-8")))
        found += [f"{module} imports {other}" for target, _ in targets if target == other]
    assert not found, "\n".join(found)
