"""The release tooling in tools/: changelog moves, bumps, ranges, tags (docs/releasing.md).

Everything runs on a made-up two-package repository in a temporary directory,
so the tests do not depend on what the real packages have released.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import api_snapshot  # noqa: E402
import bump  # noqa: E402
import check_ranges  # noqa: E402
import monorepo  # noqa: E402
import release_check  # noqa: E402

CHANGELOG = """# Changelog

All notable changes to this package.

## Unreleased

### Added
- Feature two.

### Fixed
- A bug.

## 0.1.0 - 2026-01-05

### Added
- Feature one.
"""


def _write_package(root: Path, name: str, version: str, deps: list[str]) -> None:
    import_name = name.replace("-", "_")
    directory = root / "packages" / name
    (directory / "src" / import_name).mkdir(parents=True)
    (directory / "src" / import_name / "__about__.py").write_text(f'__version__ = "{version}"\n')
    dependencies = ", ".join(json.dumps(d) for d in deps)
    (directory / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        f'[project]\nname = "{name}"\ndynamic = ["version"]\n'
        f"dependencies = [{dependencies}]\n\n"
        f'[tool.hatch.version]\npath = "src/{import_name}/__about__.py"\n'
    )
    (directory / "CHANGELOG.md").write_text(CHANGELOG)


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``packages/low`` (0.1.0) and ``packages/high`` (0.2.0, needs ``low>=0.1,<0.2``)."""
    _write_package(tmp_path, "low", "0.1.0", ["torch>=2.13"])
    _write_package(tmp_path, "high", "0.2.0", ["low>=0.1,<0.2", "torch>=2.13"])
    monkeypatch.setattr(monorepo, "ROOT", tmp_path)
    monkeypatch.setattr(monorepo, "PACKAGES_DIR", tmp_path / "packages")
    return tmp_path


def _git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
        check=True,
        capture_output=True,
    )


# Packages and ranges ---------------------------------------------------------------------


def test_packages_are_read_from_pyproject(repo: Path) -> None:
    table = monorepo.packages()
    assert sorted(table) == ["high", "low"]
    assert table["high"].import_name == "high"
    assert table["high"].version == "0.2.0"
    assert monorepo.sibling_closure("high", table) == ["low"]
    assert monorepo.sibling_closure("low", table) == []


def test_the_real_packages_form_the_documented_chain() -> None:
    table = monorepo.packages()
    assert monorepo.sibling_closure("fsdp-core", table) == []
    assert monorepo.sibling_closure("multimodal-fsdp", table) == ["fsdp-core"]
    assert monorepo.sibling_closure("model-deepseek-v41", table) == [
        "multimodal-fsdp",
        "fsdp-core",
    ]


def test_ranges_admitting_current_versions_pass(repo: Path) -> None:
    assert check_ranges.range_problems(monorepo.packages()) == []
    assert check_ranges.closure_problems(monorepo.packages(), ["high=low", "low="]) == []


def test_a_range_excluding_the_sibling_fails(repo: Path) -> None:
    (repo / "packages/low/src/low/__about__.py").write_text('__version__ = "0.2.0"\n')
    problems = check_ranges.range_problems(monorepo.packages())
    assert problems == ["high requires 'low>=0.1,<0.2', which excludes the current low 0.2.0"]


def test_open_ranges_and_paths_fail(repo: Path) -> None:
    _write_package(repo, "top", "0.1.0", ["high>=0.2", "low @ file:///somewhere"])
    problems = check_ranges.range_problems(monorepo.packages())
    assert any("'high>=0.2': the range has no upper bound" in p for p in problems)
    assert any("URL or path requirement" in p for p in problems)


def test_closure_must_match_the_noxfile(repo: Path) -> None:
    problems = check_ranges.closure_problems(monorepo.packages(), ["high="])
    assert problems == ["high: pyproject.toml depends on siblings ['low'], the noxfile expects []"]


# Changelog ---------------------------------------------------------------------------------


def test_release_moves_unreleased_under_the_version() -> None:
    text = monorepo.release_changelog(CHANGELOG, "0.2.0", "2026-03-01")
    assert text == (
        "# Changelog\n\nAll notable changes to this package.\n\n## Unreleased\n\n"
        "## 0.2.0 - 2026-03-01\n\n### Added\n- Feature two.\n\n### Fixed\n- A bug.\n\n"
        "## 0.1.0 - 2026-01-05\n\n### Added\n- Feature one.\n"
    )
    assert monorepo.changelog_problems(text, "0.2.0", for_release=True) == []


def test_release_of_a_bumped_version_folds_new_entries_in() -> None:
    bumped = monorepo.release_changelog(CHANGELOG, "0.2.0", "2026-03-01")
    later = bumped.replace("## Unreleased\n", "## Unreleased\n\n### Added\n- Feature three.\n")
    text = monorepo.release_changelog(later, "0.2.0", "2026-03-09")
    _, sections = monorepo.parse_changelog(text)
    assert [s.title for s in sections] == ["Unreleased", "0.2.0 - 2026-03-09", "0.1.0 - 2026-01-05"]
    assert sections[1].entries() == ["- Feature three.", "- Feature two.", "- A bug."]
    assert text.count("### Added") == 2  # one in 0.2.0 (merged), one in 0.1.0


def test_release_without_entries_is_refused() -> None:
    empty = monorepo.release_changelog(CHANGELOG, "0.2.0", "2026-03-01")
    with pytest.raises(ValueError, match="nothing to release"):
        monorepo.release_changelog(empty, "0.3.0", "2026-03-02")


def test_changelog_problems_for_a_release() -> None:
    problems = monorepo.changelog_problems(CHANGELOG, "0.2.0", for_release=True)
    assert len(problems) == 2
    assert "no '## 0.2.0 - <date>' section" in problems[0]
    assert "entries under '## Unreleased' would be released" in problems[1]
    assert monorepo.changelog_problems(CHANGELOG, "0.2.0", for_release=False) == []
    assert monorepo.changelog_problems("# Changelog\n", "0.2.0", for_release=False) == [
        "no '## Unreleased' section"
    ]


# Bump ---------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("hatch") is None, reason="needs hatch (nox -s bump has it)")
def test_bump_moves_version_changelog_and_snapshot(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # hatch keeps a build environment per project: keep this one out of the user's data dir.
    monkeypatch.setenv("HATCH_DATA_DIR", str(repo / ".hatch"))
    package = monorepo.get_package("low")
    package.snapshot.write_text(
        monorepo.render_snapshot({"distribution": "low", "version": "0.1.0", "api": {}})
    )
    assert bump.bump(package, "minor", "2026-03-01") == "0.2.0"
    assert package.version == "0.2.0"
    assert "## 0.2.0 - 2026-03-01" in package.changelog.read_text()
    assert monorepo.read_snapshot(package.snapshot)["version"] == "0.2.0"


def test_bump_to_the_current_unreleased_version_only_dates_it(repo: Path) -> None:
    package = monorepo.get_package("high")
    assert bump.bump(package, "0.2.0", "2026-03-01") == "0.2.0"
    assert "## 0.2.0 - 2026-03-01" in package.changelog.read_text()


def test_bump_without_unreleased_entries_changes_nothing(repo: Path) -> None:
    package = monorepo.get_package("low")
    package.changelog.write_text(monorepo.release_changelog(CHANGELOG, "0.1.1", "2026-03-01"))
    with pytest.raises(ValueError, match="nothing to release"):
        bump.bump(package, "patch", "2026-03-02")
    assert package.version == "0.1.0"


def test_bump_to_a_released_version_is_refused(repo: Path) -> None:
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "init")
    _git(repo, "tag", "high-v0.2.0")
    with pytest.raises(SystemExit, match="already released"):
        bump.bump(monorepo.get_package("high"), "0.2.0", "2026-03-01")


# Tags and released snapshots ----------------------------------------------------------------


def test_tags_and_released_snapshots(repo: Path) -> None:
    package = monorepo.get_package("low")
    released = {"distribution": "low", "version": "0.1.0", "api": {"low.f": "function()"}}
    package.snapshot.write_text(monorepo.render_snapshot(released))
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "release")
    _git(repo, "tag", "low-v0.1.0")
    _git(repo, "tag", "low-v0.0.9")
    _git(repo, "tag", "high-v0.1.0")
    _git(repo, "tag", "low-vnext")  # not a version: ignored
    assert monorepo.release_tags(package) == {"0.1.0": "low-v0.1.0", "0.0.9": "low-v0.0.9"}
    assert monorepo.previous_release(package) == ("0.1.0", "low-v0.1.0")
    assert monorepo.previous_release(package, "0.0.9") == ("0.0.9", "low-v0.0.9")
    assert monorepo.previous_release(package, "0.0.1") is None
    # The snapshot is read from the tag, not from the working tree.
    package.snapshot.write_text(monorepo.render_snapshot({**released, "api": {}}))
    assert api_snapshot.released_api(package) == ("0.1.0", {"low.f": "function()"})


def test_tag_checks(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(release_check, "published", lambda name, version: version == "0.1.0")
    assert release_check.tag_problems("nope-v1.0.0")[0].startswith("tag 'nope-v1.0.0' is not")
    assert "belongs to low" in release_check.tag_problems("low-v0.1.0", "high")[0]
    problems = release_check.tag_problems("low-v0.1.0")
    assert any("already on" in p for p in problems)
    assert any("entries under '## Unreleased'" in p for p in problems)
    problems = release_check.tag_problems("high-v0.3.0")
    assert any("tag high-v0.3.0 says 0.3.0 but __about__.py says 0.2.0" in p for p in problems)
    # A properly bumped package passes.
    changelog = monorepo.get_package("high").changelog
    changelog.write_text(monorepo.release_changelog(CHANGELOG, "0.2.0", "2026-03-01"))
    assert release_check.tag_problems("high-v0.2.0") == []
