"""Move one package to a new version: ``__about__.py``, CHANGELOG and API snapshot together.

Usage (``nox -s bump -- <package> <level>`` runs exactly this)::

    python tools/bump.py multimodal-fsdp minor      # 0.1.3 -> 0.2.0
    python tools/bump.py fsdp-core patch            # 0.1.0 -> 0.1.1
    python tools/bump.py model-deepseek-v41 1.0.0   # an explicit version
    python tools/bump.py fsdp-core 0.1.0            # the current, not yet tagged version:
                                                    # only date it and fold Unreleased into it

1. ``hatch version <level>`` in the package directory writes the new version
   into ``src/<import_name>/__about__.py`` (hatch refuses to go backwards).
2. The CHANGELOG's ``## Unreleased`` entries move under ``## X.Y.Z - <date>``
   and a fresh, empty ``## Unreleased`` stays on top.
3. ``api-snapshot.json`` is re-stamped with the new version (its API is left
   as it is: the snapshot test still compares it with the code).

Then commit, and after merging tag the release commit ``<package>-vX.Y.Z``
(see docs/releasing.md).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import monorepo


def hatch_version(package: monorepo.Package, target: str) -> None:
    hatch = shutil.which("hatch")
    if hatch is None:
        raise SystemExit("hatch is not on PATH: run `nox -s bump -- ...` or `pip install hatch`")
    subprocess.run([hatch, "version", target], cwd=package.directory, check=True)


def restamp_snapshot(package: monorepo.Package, version: str) -> bool:
    if not package.snapshot.is_file():
        return False
    data = monorepo.read_snapshot(package.snapshot)
    data["version"] = version
    package.snapshot.write_text(monorepo.render_snapshot(data), encoding="utf-8")
    return True


def bump(package: monorepo.Package, target: str, date: str) -> str:
    """Apply the bump and return the new version."""
    old = package.version
    changelog = package.changelog.read_text(encoding="utf-8")
    if target == old:
        if old in monorepo.release_tags(package):
            raise SystemExit(
                f"{package.name} {old} is already released (tag {package.tag(old)}); "
                "choose a higher version"
            )
        new = old
    else:
        # Check the changelog first so a refused bump leaves every file untouched.
        _, sections = monorepo.parse_changelog(changelog)
        unreleased = monorepo.find_section(sections, monorepo.UNRELEASED)
        if unreleased is None or not unreleased.entries():
            raise ValueError(
                f"nothing to release: {package.changelog.name} has no entries under "
                f"'## {monorepo.UNRELEASED}'"
            )
        hatch_version(package, target)
        new = package.version
    package.changelog.write_text(monorepo.release_changelog(changelog, new, date), encoding="utf-8")
    restamp_snapshot(package, new)
    return new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", help="distribution name, e.g. multimodal-fsdp")
    parser.add_argument("target", help="major, minor, patch (any hatch segment) or X.Y.Z")
    parser.add_argument(
        "--date",
        default=datetime.date.today().isoformat(),
        help="release date for the CHANGELOG heading (default: today)",
    )
    args = parser.parse_args(argv)
    package = monorepo.get_package(args.package)
    old = package.version
    try:
        new = bump(package, args.target, args.date)
    except ValueError as error:
        raise SystemExit(f"{package.name}: {error}") from None
    print(f"{package.name}: {old} -> {new}")
    print(f"  {package.about_file.relative_to(monorepo.ROOT)}")
    print(f"  {package.changelog.relative_to(monorepo.ROOT)}: '## {new} - {args.date}'")
    if package.snapshot.is_file():
        print(f"  {package.snapshot.relative_to(monorepo.ROOT)}: version {new}")
    print(
        "Next: review and commit; once merged, tag the release commit and push the tag:\n"
        f"  git tag {package.tag(new)} && git push origin {package.tag(new)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
