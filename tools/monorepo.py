"""What the release tooling knows about the monorepo, in one place.

Everything is read from the files a release is made of: each package's
``pyproject.toml`` (name, dependencies, the ``__about__.py`` that holds the
version), its ``CHANGELOG.md``, its ``api-snapshot.json`` and the git tags
``<package>-vX.Y.Z``. Only the standard library is needed, except for the
functions that compare versions or ranges, which import ``packaging`` lazily
(pytest, hatch and twine all depend on it).

Used by ``tools/bump.py``, ``tools/api_snapshot.py``, ``tools/check_ranges.py``,
``tools/release_check.py`` and the tests in ``tests/``.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES_DIR = ROOT / "packages"
SNAPSHOT_NAME = "api-snapshot.json"
UNRELEASED = "Unreleased"

_VERSION_LINE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.MULTILINE)
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_HEADING = re.compile(r"^## +(.+?)\s*$")
_SUBHEADING = re.compile(r"^### +(.+?)\s*$")


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name (``Model_DeepSeek.V41`` -> ``model-deepseek-v41``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# Packages -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Package:
    """One distribution of the monorepo, as its ``pyproject.toml`` describes it."""

    name: str
    directory: Path
    import_name: str
    about_file: Path
    dependencies: tuple[str, ...]

    @property
    def version(self) -> str:
        """The version in ``src/<import_name>/__about__.py`` (read, not imported)."""
        return read_version(self.about_file)

    @property
    def changelog(self) -> Path:
        return self.directory / "CHANGELOG.md"

    @property
    def snapshot(self) -> Path:
        return self.directory / SNAPSHOT_NAME

    @property
    def tag_prefix(self) -> str:
        return f"{self.name}-v"

    def tag(self, version: str | None = None) -> str:
        """The release tag of ``version`` (default: the current version)."""
        return f"{self.tag_prefix}{version or self.version}"


def read_version(about_file: Path) -> str:
    match = _VERSION_LINE.search(about_file.read_text(encoding="utf-8"))
    if match is None:
        raise ValueError(f"{about_file}: no __version__ = '...' line")
    return match.group(1)


def load_package(directory: Path) -> Package:
    data = tomllib.loads((directory / "pyproject.toml").read_text(encoding="utf-8"))
    project = data["project"]
    about = directory / data["tool"]["hatch"]["version"]["path"]
    return Package(
        name=canonical(project["name"]),
        directory=directory,
        import_name=about.parent.name,
        about_file=about,
        dependencies=tuple(project.get("dependencies", ())),
    )


def packages() -> dict[str, Package]:
    """Every package under ``packages/``, by distribution name."""
    found = [
        load_package(d) for d in sorted(PACKAGES_DIR.iterdir()) if (d / "pyproject.toml").is_file()
    ]
    return {package.name: package for package in found}


def get_package(name: str) -> Package:
    table = packages()
    key = canonical(name)
    if key not in table:
        raise SystemExit(f"unknown package {name!r}; packages: {', '.join(table)}")
    return table[key]


def requirement_name(requirement: str) -> str:
    match = _REQ_NAME.match(requirement)
    if match is None:
        raise ValueError(f"cannot read a distribution name from {requirement!r}")
    return canonical(match.group(1))


def sibling_requirements(package: Package, siblings: Iterable[str]) -> list[str]:
    """The requirements of ``package`` that name another package of the monorepo."""
    names = {canonical(s) for s in siblings}
    return [r for r in package.dependencies if requirement_name(r) in names]


def sibling_closure(name: str, table: Mapping[str, Package] | None = None) -> list[str]:
    """The monorepo packages ``name`` depends on, directly or not (lowest layer last)."""
    table = table or packages()
    order: list[str] = []

    def visit(current: str) -> None:
        for requirement in sibling_requirements(table[current], table):
            dep = requirement_name(requirement)
            if dep not in order:
                order.append(dep)
                visit(dep)

    visit(canonical(name))
    return order


# Changelog ----------------------------------------------------------------------------


@dataclass
class Section:
    """A ``## heading`` of a changelog and the lines below it (up to the next one)."""

    title: str
    lines: list[str]

    @property
    def version(self) -> str:
        """``0.2.0`` for ``## 0.2.0 - 2026-01-31``, ``Unreleased`` for ``## Unreleased``."""
        return self.title.split(" - ")[0].strip()

    def entries(self) -> list[str]:
        """The change lines: not blank, not sub-headings (``### Added``)."""
        return [ln for ln in self.lines if ln.strip() and not _SUBHEADING.match(ln)]


def parse_changelog(text: str) -> tuple[list[str], list[Section]]:
    """The preamble (title and introduction) and the ``##`` sections, in order."""
    preamble: list[str] = []
    sections: list[Section] = []
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            sections.append(Section(heading.group(1), []))
        elif sections:
            sections[-1].lines.append(line)
        else:
            preamble.append(line)
    return preamble, sections


def render_changelog(preamble: list[str], sections: list[Section]) -> str:
    out = list(preamble)
    while out and not out[-1].strip():
        out.pop()
    for section in sections:
        body = list(section.lines)
        while body and not body[0].strip():
            body.pop(0)
        while body and not body[-1].strip():
            body.pop()
        out += ["", f"## {section.title}", *(["", *body] if body else [])]
    return "\n".join(out) + "\n"


def find_section(sections: list[Section], version: str) -> Section | None:
    for section in sections:
        if section.version == version:
            return section
    return None


def _groups(lines: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Lines before the first ``###`` and the lines of each ``###`` group, blanks dropped."""
    head: list[str] = []
    groups: dict[str, list[str]] = {}
    current: list[str] = head
    for line in lines:
        sub = _SUBHEADING.match(line)
        if sub:
            current = groups.setdefault(sub.group(1), [])
        elif line.strip():
            current.append(line)
    return head, groups


def _merge_bodies(newer: list[str], older: list[str]) -> list[str]:
    """Merge two section bodies group by group (``### Added`` with ``### Added``), newer first."""
    new_head, new_groups = _groups(newer)
    old_head, old_groups = _groups(older)
    merged: dict[str, list[str]] = {}
    for name in [*new_groups, *(g for g in old_groups if g not in new_groups)]:
        merged[name] = new_groups.get(name, []) + old_groups.get(name, [])
    out = new_head + old_head
    for name, lines in merged.items():
        out += ["", f"### {name}", *lines] if out else [f"### {name}", *lines]
    return out


def release_changelog(text: str, version: str, date: str) -> str:
    """Move the ``## Unreleased`` entries under ``## <version> - <date>``.

    A fresh, empty ``## Unreleased`` stays on top. When a section for
    ``version`` already exists (the version was bumped before its release),
    the unreleased entries are merged into it and its date is renewed.
    Refuses when there is nothing to release.
    """
    preamble, sections = parse_changelog(text)
    unreleased = find_section(sections, UNRELEASED)
    pending = unreleased.lines if unreleased is not None else []
    existing = find_section(sections, version)
    if not Section("", pending).entries() and existing is None:
        raise ValueError(
            f"nothing to release: the changelog has no entries under '## {UNRELEASED}' "
            f"and no section for {version}"
        )
    released = Section(
        f"{version} - {date}", _merge_bodies(pending, existing.lines if existing else [])
    )
    rest = [s for s in sections if s is not unreleased and s is not existing]
    return render_changelog(preamble, [Section(UNRELEASED, []), released, *rest])


def changelog_problems(
    text: str, version: str, *, for_release: bool, package: str = "<package>"
) -> list[str]:
    """What is wrong with a changelog for the current ``version`` (empty when fine).

    Always: there must be a ``## Unreleased`` section. For a release (a tag of
    ``version`` is being pushed), ``version`` must have its own section and
    ``Unreleased`` must be empty, so that the published notes are complete.
    """
    _, sections = parse_changelog(text)
    problems: list[str] = []
    unreleased = find_section(sections, UNRELEASED)
    if unreleased is None:
        problems.append(f"no '## {UNRELEASED}' section")
    if for_release:
        section = find_section(sections, version)
        if section is None or not section.entries():
            problems.append(f"no '## {version} - <date>' section with entries")
        if unreleased is not None and unreleased.entries():
            problems.append(
                f"entries under '## {UNRELEASED}' would be released as {version} without "
                f"being listed under it: run `nox -s bump -- {package} {version}`"
            )
    return problems


def documents_changes(text: str, version: str) -> bool:
    """Whether the changelog lists changes not yet released: under ``Unreleased``, or under
    the section of the current (bumped, not yet tagged) version."""
    _, sections = parse_changelog(text)
    return any(
        section is not None and bool(section.entries())
        for section in (find_section(sections, UNRELEASED), find_section(sections, version))
    )


# Git tags -----------------------------------------------------------------------------


def git(*args: str) -> str | None:
    """Output of a git command in the repository, or ``None`` without git or a repository."""
    try:
        result = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return result.stdout if result.returncode == 0 else None


def release_tags(package: Package) -> dict[str, str]:
    """``{version: tag}`` of the package's release tags known to the local repository."""
    out = git("tag", "--list", f"{package.tag_prefix}*")
    if not out:
        return {}
    tags = {}
    for tag in out.split():
        version = tag.removeprefix(package.tag_prefix)
        if re.fullmatch(r"\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?(\.dev\d+)?", version):
            tags[version] = tag
    return tags


def previous_release(package: Package, version: str | None = None) -> tuple[str, str] | None:
    """The highest released ``(version, tag)`` not above ``version`` (default: current)."""
    tags = release_tags(package)
    if not tags:
        return None
    from packaging.version import Version

    current = Version(version or package.version)
    candidates = [(Version(v), v, t) for v, t in tags.items()]
    eligible = [c for c in candidates if c[0] <= current]
    if not eligible:
        return None
    _, released, tag = max(eligible)
    return released, tag


def file_at(ref: str, path: Path) -> str | None:
    """The text of ``path`` at git ``ref`` (``None`` when it did not exist there)."""
    return git("show", f"{ref}:{path.relative_to(ROOT).as_posix()}")


# API snapshots ------------------------------------------------------------------------


def read_snapshot(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def render_snapshot(data: Mapping[str, Any]) -> str:
    """Distribution and version first, then the API sorted by name (one line per entry)."""
    ordered = {key: data[key] for key in ("distribution", "version") if key in data}
    ordered.update({key: value for key, value in data.items() if key not in ordered})
    ordered["api"] = dict(sorted(dict(data.get("api", {})).items()))
    return json.dumps(ordered, indent=2) + "\n"


@dataclass(frozen=True)
class ApiDiff:
    """How one API (``{qualified name: description}``) differs from an older one."""

    removed: tuple[str, ...]
    changed: tuple[str, ...]
    added: tuple[str, ...]

    @property
    def breaking(self) -> bool:
        return bool(self.removed or self.changed)

    def __bool__(self) -> bool:
        return bool(self.removed or self.changed or self.added)

    def describe(self, old: Mapping[str, str], new: Mapping[str, str], limit: int = 40) -> str:
        lines = [f"- removed {name}: {old[name]}" for name in self.removed]
        for name in self.changed:
            lines += [f"~ changed {name}", f"    was: {old[name]}", f"    now: {new[name]}"]
        lines += [f"+ added   {name}: {new[name]}" for name in self.added]
        if len(lines) > limit:
            lines = [*lines[:limit], f"... and {len(lines) - limit} more lines"]
        return "\n".join(lines)


def diff_api(old: Mapping[str, str], new: Mapping[str, str]) -> ApiDiff:
    return ApiDiff(
        removed=tuple(sorted(set(old) - set(new))),
        changed=tuple(sorted(k for k in set(old) & set(new) if old[k] != new[k])),
        added=tuple(sorted(set(new) - set(old))),
    )


def required_bump(released: str, diff: ApiDiff) -> str | None:
    """The smallest version change the API change needs after ``released``.

    ``"major"`` / ``"minor"`` / ``"patch"``, or ``None`` when the API did not
    change. Downstream projects pin ``>=A.B,<A.(B+1)`` before 1.0 and
    ``>=A,<A+1`` after it, so a breaking change (a name removed or a signature
    changed) must leave that range: a minor bump before 1.0, a major one after.
    Additions need a minor bump after 1.0; before 1.0 any bump will do.
    """
    from packaging.version import Version

    if not diff:
        return None
    zero = Version(released).major == 0
    if diff.breaking:
        return "minor" if zero else "major"
    return "patch" if zero else "minor"


def bump_level(old: str, new: str) -> str | None:
    """Which release component changed from ``old`` to ``new`` (``None`` if not increased)."""
    from packaging.version import Version

    a, b = Version(old), Version(new)
    if b <= a:
        return None
    ra = (*a.release, 0, 0)[:3]
    rb = (*b.release, 0, 0)[:3]
    if rb[0] != ra[0]:
        return "major"
    if rb[1] != ra[1]:
        return "minor"
    return "patch"


_LEVELS = {"patch": 0, "minor": 1, "major": 2}


def api_version_problems(
    package_name: str,
    released: str,
    current: str,
    diff: ApiDiff,
    changelog_text: str,
) -> list[str]:
    """Why an API that differs from the release ``released`` cannot ship as ``current``."""
    need = required_bump(released, diff)
    if need is None:
        return []
    problems: list[str] = []
    have = bump_level(released, current)
    kind = (
        "a breaking change (names removed or signatures changed)" if diff.breaking else "new names"
    )
    if have is None:
        problems.append(
            f"{package_name} {released} is released with another public API; {kind} needs a "
            f"new version: `nox -s bump -- {package_name} {need}`"
        )
    elif _LEVELS[have] < _LEVELS[need]:
        problems.append(
            f"{kind} after {package_name} {released} needs at least a {need} bump, but "
            f"{current} is only a {have} bump: `nox -s bump -- {package_name} <version>`"
        )
    if not documents_changes(changelog_text, current):
        problems.append(
            f"the public API changed since {package_name} {released} but CHANGELOG.md lists "
            f"no change under '## {UNRELEASED}' or '## {current}'"
        )
    return problems
