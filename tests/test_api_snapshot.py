"""The public API of every package is the one its ``api-snapshot.json`` records.

Downstream frameworks pin ``multimodal-fsdp`` (and may pin the other two), so
the public API (names and signatures, see ``tools/api_snapshot.py``) may not
change unnoticed:

- the snapshot must describe the installed code and carry the package's
  current version (regenerate with ``python tools/api_snapshot.py``);
- once a version is released (tag ``<package>-vX.Y.Z``), its API is final: a
  different API needs a higher version, by at least the level the change
  requires, and a CHANGELOG entry.

docs/releasing.md explains the rules and the commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import api_snapshot  # noqa: E402
import monorepo  # noqa: E402

PACKAGE_NAMES = sorted(monorepo.packages())


@pytest.fixture(params=PACKAGE_NAMES)
def package(request: pytest.FixtureRequest) -> monorepo.Package:
    return monorepo.get_package(request.param)


def test_snapshot_describes_the_code(package: monorepo.Package) -> None:
    problems = api_snapshot.stale_problems(package)
    assert not problems, "\n\n".join(problems)


def test_released_api_changes_only_with_a_new_version(package: monorepo.Package) -> None:
    if api_snapshot.released_api(package) is None:
        pytest.skip(
            f"no release tag {package.tag_prefix}* with a snapshot in this checkout "
            "(CI fetches tags; nothing released yet is fine)"
        )
    problems = api_snapshot.release_problems(package)
    assert not problems, "\n".join(problems)


def test_snapshot_lists_the_public_names(package: monorepo.Package) -> None:
    import importlib

    recorded = monorepo.read_snapshot(package.snapshot)["api"]
    module = importlib.import_module(package.import_name)
    exported = [name for name in module.__all__ if name != "__version__"]
    missing = [name for name in exported if f"{package.import_name}.{name}" not in recorded]
    assert not missing


# The rules themselves, on made-up APIs -------------------------------------------------

OLD = {"pkg.f": "function(x: 'int')", "pkg.C": "class() bases=(builtins.object)"}


@pytest.mark.parametrize(
    ("new", "released", "need"),
    [
        (OLD, "0.3.1", None),
        ({**OLD, "pkg.g": "function()"}, "0.3.1", "patch"),
        ({**OLD, "pkg.g": "function()"}, "1.3.1", "minor"),
        ({"pkg.f": "function(x: 'int')"}, "0.3.1", "minor"),
        ({**OLD, "pkg.f": "function(x: 'int', y: 'int')"}, "0.3.1", "minor"),
        ({"pkg.C": OLD["pkg.C"]}, "2.0.0", "major"),
    ],
)
def test_required_bump(new: dict[str, str], released: str, need: str | None) -> None:
    assert monorepo.required_bump(released, monorepo.diff_api(OLD, new)) == need


CHANGELOG = "# Changelog\n\n## Unreleased\n\n### Added\n- `pkg.g`.\n\n## 0.3.1 - 2026-01-01\n- x\n"
EMPTY_UNRELEASED = "# Changelog\n\n## Unreleased\n\n## 0.3.1 - 2026-01-01\n- x\n"


@pytest.mark.parametrize(
    ("new", "current", "changelog", "expected"),
    [
        # Nothing changed: any version, any changelog.
        (OLD, "0.3.1", EMPTY_UNRELEASED, []),
        # A released version cannot change its API.
        ({**OLD, "pkg.g": "function()"}, "0.3.1", CHANGELOG, ["is released with another"]),
        # An addition after 0.3.1: a patch bump is enough before 1.0, with a changelog entry.
        ({**OLD, "pkg.g": "function()"}, "0.3.2", CHANGELOG, []),
        ({**OLD, "pkg.g": "function()"}, "0.3.2", EMPTY_UNRELEASED, ["lists no change"]),
        # A removal needs a minor bump before 1.0.
        ({"pkg.f": OLD["pkg.f"]}, "0.3.2", CHANGELOG, ["needs at least a minor bump"]),
        ({"pkg.f": OLD["pkg.f"]}, "0.4.0", CHANGELOG, []),
    ],
)
def test_api_version_problems(
    new: dict[str, str], current: str, changelog: str, expected: list[str]
) -> None:
    diff = monorepo.diff_api(OLD, new)
    problems = monorepo.api_version_problems("pkg", "0.3.1", current, diff, changelog)
    assert len(problems) == len(expected)
    for problem, fragment in zip(problems, expected, strict=True):
        assert fragment in problem


def test_a_bumped_version_section_documents_changes() -> None:
    text = "# Changelog\n\n## Unreleased\n\n## 0.4.0 - 2026-02-01\n\n### Removed\n- `pkg.C`.\n"
    assert monorepo.documents_changes(text, "0.4.0")
    assert not monorepo.documents_changes(text, "0.5.0")


def test_diff_is_described_for_humans() -> None:
    new = {"pkg.f": "function(x: 'str')", "pkg.g": "function()"}
    diff = monorepo.diff_api(OLD, new)
    assert diff.removed == ("pkg.C",)
    assert diff.changed == ("pkg.f",)
    assert diff.added == ("pkg.g",)
    text = diff.describe(OLD, new)
    assert "- removed pkg.C" in text
    assert "was: function(x: 'int')" in text
    assert "now: function(x: 'str')" in text
    assert "+ added   pkg.g" in text


def test_descriptions_are_stable_and_address_free() -> None:
    def sample(a: int, *, key: object = object()) -> None:
        """A default whose repr holds a memory address."""

    text = dict(api_snapshot.describe(sample))[""]
    assert " at 0x" not in text
    assert text.startswith("function(a: 'int', *, key: 'object' = <object object")


def test_snapshot_records_no_private_names(package: monorepo.Package) -> None:
    """Underscore names are private, except the reference contract's few."""
    recorded = monorepo.read_snapshot(package.snapshot)["api"]
    private = [
        key
        for key in recorded
        if any(
            part.startswith("_") and part not in api_snapshot.CONTRACT_UNDERSCORE_NAMES
            for part in key.split(".")
        )
    ]
    assert not private, f"{package.snapshot.name} records private names: {private}"


def test_only_contract_underscore_methods_are_described() -> None:
    class Strategy:
        def _helper(self) -> None: ...

        def _fully_shard_module(self) -> None: ...

        def run(self) -> None: ...

    members = {key for key, _ in api_snapshot.describe(Strategy)}
    assert members == {"", "._fully_shard_module", ".run"}
