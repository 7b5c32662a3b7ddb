"""docs/architecture.md matches the code.

The page maps every module of the three packages; this test fails when a module is
added, moved or removed without the map following, and when the page names a module
or object that no longer exists. (The strict docs build checks the links themselves:
each ``[module][]`` must resolve to an API-reference entry.)
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = ("fsdp-core", "multimodal-fsdp", "model-deepseek-v41")
#: A dotted name in one of the packages' import namespaces.
DOTTED = re.compile(r"\b(?:fsdp_core|multimodal_fsdp|model_deepseek_v41)(?:\.\w+)*")
#: A module in the first column of a "where each concept lives" table.
TABLE_ROW = re.compile(r"^\|\s*(?:\[([\w.]+)\]\[\]|`([\w.]+)`)\s*\|", re.MULTILINE)


def _modules(package: str) -> list[str]:
    """Every module of a package (private ones too), from its source tree."""
    src = ROOT / "packages" / package / "src"
    modules = []
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] != "__about__":
            modules.append(".".join(parts))
    return modules


def _resolve(name: str) -> object:
    """The module or object a dotted name refers to (longest importable module prefix,
    then attributes); raises LookupError when there is none."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(target, attr):
                raise LookupError(f"{'.'.join(parts[:cut])} has no {attr!r} (in {name})")
            target = getattr(target, attr)
        return target
    raise LookupError(f"no module {parts[0]}")


def test_the_page_is_in_the_navigation() -> None:
    assert "architecture.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_has_a_row(package: str) -> None:
    rows = {a or b for a, b in TABLE_ROW.findall(PAGE.read_text(encoding="utf-8"))}
    missing = [m for m in _modules(package) if m not in rows]
    assert not missing, f"docs/architecture.md has no row for {missing}"


def test_every_row_is_a_module() -> None:
    rows = [a or b for a, b in TABLE_ROW.findall(PAGE.read_text(encoding="utf-8"))]
    known = {m for package in PACKAGES for m in _modules(package)}
    assert len(rows) == len(set(rows)), "a module has two rows"
    stale = [row for row in rows if row not in known]
    assert not stale, f"docs/architecture.md has rows for modules that do not exist: {stale}"


def test_every_name_on_the_page_exists() -> None:
    stale = []
    for name in sorted(set(DOTTED.findall(PAGE.read_text(encoding="utf-8")))):
        try:
            _resolve(name)
        except LookupError as error:
            stale.append(str(error))
    assert not stale, "docs/architecture.md names what does not exist:\n" + "\n".join(stale)


def test_the_resolver_rejects_stale_names() -> None:
    assert isinstance(_resolve("multimodal_fsdp.runtime.schedule_check"), ModuleType)
    assert callable(_resolve("fsdp_core.sharding.apply_fully_shard"))
    for stale in ("multimodal_fsdp.no_such_module", "fsdp_core.sharding.no_such_name"):
        with pytest.raises(LookupError):
            _resolve(stale)
