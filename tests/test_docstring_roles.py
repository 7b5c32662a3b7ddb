"""No Sphinx roles in the sources: the API reference (mkdocstrings, Markdown) would
render ``:func:`name``` literally. Docstrings link with the autorefs form
``[name][fully.qualified.name]`` (an object on an API page) or write ``name``.
The docs build fails on one too (tools/mkdocs_hooks.py); this test names the line."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|data|meth|attr|exc|obj|const):`")


def raw_roles(root: Path = ROOT) -> list[str]:
    """``file:line: text`` for every Sphinx role under packages/*/src."""
    found = []
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ROLE.search(line):
                found.append(f"{path.relative_to(root).as_posix()}:{number}: {line.strip()}")
    return found


def test_the_scanner_finds_a_role(tmp_path: Path) -> None:
    source = tmp_path / "packages" / "p" / "src" / "p" / "m.py"
    source.parent.mkdir(parents=True)
    source.write_text('"""See :func:`f` and [g][p.m.g]."""\n\n\ndef f() -> None: ...\n')
    assert raw_roles(tmp_path) == ['packages/p/src/p/m.py:1: """See :func:`f` and [g][p.m.g]."""']


def test_no_sphinx_roles_in_the_sources() -> None:
    found = raw_roles()
    assert not found, (
        f"{len(found)} Sphinx roles render literally in the API reference; write "
        "[name][fully.qualified.name] or ``name``:\n" + "\n".join(found)
    )
