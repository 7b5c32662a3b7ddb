"""fsdp_core.hf: loaded only on request; the one place naming transformers' private attributes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from fsdp_core.hf import _transformers

SRC = Path(__file__).resolve().parents[1] / "src" / "fsdp_core"


def test_import_fsdp_core_does_not_load_hf() -> None:
    code = "import fsdp_core, sys; assert 'fsdp_core.hf' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def _spelled(tree: ast.AST, names: frozenset[str]) -> list[tuple[int, str]]:
    """Attribute accesses and string constants in ``tree`` that are one of ``names``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and node.value in names:
            found.append((node.lineno, str(node.value)))
    return found


def test_transformers_attributes_are_named_only_in_one_module() -> None:
    names = frozenset(_transformers.ALL)
    own = SRC / "hf" / "_transformers.py"
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path == own:
            continue
        for line, name in _spelled(ast.parse(path.read_text(encoding="utf-8")), names):
            offenders.append(f"{path.relative_to(SRC)}:{line}: {name}")
    assert not offenders, "use fsdp_core.hf._transformers instead of spelling:\n" + "\n".join(
        offenders
    )


def test_the_check_sees_a_spelled_attribute() -> None:
    tree = ast.parse("getattr(model, '_is_hf_initialized', None)\nmodel._init_weights(m)\n")
    assert _spelled(tree, frozenset(_transformers.ALL)) == [
        (1, "_is_hf_initialized"),
        (2, "_init_weights"),
    ]
