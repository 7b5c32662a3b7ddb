"""Private torch is reached only through ``fsdp_core.internals``.

A renamed private attribute or module must fail in one place, with a message naming
it, not silently switch a fix off somewhere else. So no module under
``packages/*/src`` outside the ``fsdp_core/internals`` package:

- imports a private torch module: a dotted path with a component starting with
  ``_`` (``torch.utils._python_dispatch``, ``torch.distributed._tools``), or a
  private name from a torch module, by ``import``, ``from ... import`` or
  ``importlib.import_module`` / ``__import__`` with a literal name;
- reads a private attribute of something it got from torch: an attribute chain
  rooted at a name bound by a torch import (``torch._C``,
  ``torch.autograd.Variable._execution_engine``), also through ``getattr`` /
  ``hasattr`` / ``setattr`` / ``delattr`` with a literal name;
- names one of the known private attributes of torch objects it cannot see the type of
  (FSDP2's state, parameter groups and parameters, the memory tracker, autograd's
  engine), as an attribute or as a string (``getattr(x, "_param_fqn")``).

Like ``tests/test_import_layers.py``, the check reads the sources, so lazy imports
inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("packages/*/src"))
ALLOWED = ROOT / "packages" / "fsdp-core" / "src" / "fsdp_core" / "internals"

#: Private attributes of torch objects whose type the source cannot show (FSDP2's
#: ``FSDPState`` / ``FSDPParamGroup`` / ``FSDPParam``, the ``FSDPMemTracker``, the
#: autograd engine, a process group's backend). Some have no underscore but are FSDP2
#: internals all the same.
KNOWN_PRIVATE = frozenset(
    {
        "_get_fsdp_state",
        "_fsdp_param_group",
        "_fsdp_param_groups",
        "_unsharded_param",
        "unsharded_accumulated_grad",
        "_param_fqn",
        "_is_root",
        "_lazy_init",
        "fsdp_params",
        "reduce_grads",
        "_curr_mem_snap",
        "_in_opt",
        "_mod_tracker",
        "_update_peak_stats",
        "_execution_engine",
        "_current_graph_task_id",
        "_register_group_forward_hooks",
        "_cast_output_dtype",
        "_force_complete_incomplete_states",
        "_get_backend",
    }
)

_ATTRIBUTE_CALLS = frozenset({"getattr", "hasattr", "setattr", "delattr"})


def _private(component: str) -> bool:
    return component.startswith("_") and not (
        component.startswith("__") and component.endswith("__")
    )


def _private_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(_private(part) for part in parts)


def _torch_names(tree: ast.AST) -> set[str]:
    """Names bound (anywhere in the module) by importing torch or something from it."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "torch"
        ):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """The root name of ``a.b.c`` (``None`` when it is not a plain name) and the attributes."""
    attrs: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        attrs.append(current.attr)
        current = current.value
    root = current.id if isinstance(current, ast.Name) else None
    return root, attrs[::-1]


def private_torch_uses(source: str) -> list[str]:
    """Every private torch access in ``source``, as ``line: what``."""
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    found: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private_module(alias.name):
                    report(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _private_module(node.module):
                report(node, f"from {node.module} import ...")
            elif node.module.split(".")[0] == "torch":
                for alias in node.names:
                    if _private(alias.name):
                        report(node, f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            root, attrs = _chain(node)
            if node.attr in KNOWN_PRIVATE and root != "internals":
                report(node, f".{node.attr}")
            elif root in torch_names and _private(node.attr):
                report(node, ".".join([root or "", *attrs]))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            literal = first.value if isinstance(first, ast.Constant) else None
            if name in ("import_module", "__import__") and _private_module(str(literal)):
                report(node, f"{name}({literal!r})")
            if name in _ATTRIBUTE_CALLS and len(node.args) > 1:
                attr = node.args[1]
                if not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)):
                    continue
                target = first
                while isinstance(target, ast.Attribute):
                    target = target.value
                rooted = isinstance(target, ast.Name) and target.id in torch_names
                if attr.value in KNOWN_PRIVATE or (rooted and _private(attr.value)):
                    report(node, f"{name}(..., {attr.value!r})")
        elif isinstance(node, ast.Constant) and node.value in KNOWN_PRIVATE:
            report(node, f"the string {node.value!r}")
    # A string named in a getattr call is also a constant: report each line once.
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


def offenders() -> dict[str, list[str]]:
    problems: dict[str, list[str]] = {}
    for source_root in SOURCES:
        for path in sorted(source_root.rglob("*.py")):
            if ALLOWED in path.parents:
                continue
            uses = private_torch_uses(path.read_text(encoding="utf-8"))
            if uses:
                problems[str(path.relative_to(ROOT))] = uses
    return problems


def test_the_sources_are_found() -> None:
    assert len(SOURCES) >= 3
    assert (ALLOWED / "__init__.py").is_file()


def test_private_torch_is_reached_only_through_internals() -> None:
    problems = offenders()
    assert not problems, (
        "private torch outside fsdp_core.internals (add an accessor there): "
        + "; ".join(f"{path} -> {uses}" for path, uses in problems.items())
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "from torch.utils._python_dispatch import TorchDispatchMode\n",
            "from torch.utils._python_dispatch",
        ),
        (
            "import torch.distributed._tools.fsdp2_mem_tracker as t\n",
            "import torch.distributed._tools",
        ),
        ("from torch.distributed.fsdp import _fully_shard\n", "import _fully_shard"),
        (
            "def f():\n    import importlib\n"
            "    return importlib.import_module('torch.distributed.fsdp._fully_shard.x')\n",
            "import_module('torch.distributed.fsdp._fully_shard.x')",
        ),
        ("import torch\nx = torch._C._current_graph_task_id()\n", "torch._C"),
        ("import torch\nx = torch.autograd.Variable._execution_engine\n", "_execution_engine"),
        ("from torch import nn\nnn.Module._apply\n", "nn.Module._apply"),
        ("import torch\nhasattr(torch.nn, '_secret')\n", "hasattr(..., '_secret')"),
        ("def f(p):\n    return getattr(p, '_param_fqn', None)\n", "getattr(..., '_param_fqn')"),
        ("def f(tracker):\n    return tracker._curr_mem_snap\n", "._curr_mem_snap"),
        ("NEEDS = ('_in_opt', '_mod_tracker')\n", "the string '_in_opt'"),
        ("def f(unit):\n    return unit._get_fsdp_state()\n", "._get_fsdp_state"),
    ],
)
def test_the_check_sees_each_kind_of_access(source: str, expected: str) -> None:
    uses = private_torch_uses(source)
    assert any(expected in use for use in uses), uses


def test_the_check_leaves_public_and_own_names_alone() -> None:
    source = (
        "import torch\n"
        "from fsdp_core import internals\n"
        "class Hook:\n"
        "    def __init__(self):\n"
        "        self._handles = []\n"
        "        self._watch = None\n"
        "    def run(self, unit):\n"
        "        return internals.fsdp_params(unit), torch.__version__, self._handles\n"
        "import importlib\n"
        "importlib.import_module('safetensors.torch')\n"
        "importlib.import_module('torch.distributed.fsdp')\n"
    )
    assert private_torch_uses(source) == []
