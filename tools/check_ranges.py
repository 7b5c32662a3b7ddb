"""Check the dependency ranges between the monorepo's packages (``nox -s check_ranges``).

For every package and every requirement that names a sibling package:

- the range must admit the sibling's current version (otherwise the packages
  released together could not be installed together);
- the range must have an upper bound (downstream pins rely on it: a breaking
  release of the sibling must not be picked up silently);
- the requirement must be a plain range, not a path or URL (development
  overrides must stay out of the published metadata).

With ``--expect NAME=DEP,DEP`` (the noxfile passes its ``PACKAGES`` table),
the siblings each package depends on, directly or not, must be exactly those.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import monorepo


def range_problems(table: dict[str, monorepo.Package]) -> list[str]:
    from packaging.requirements import Requirement
    from packaging.version import Version

    problems: list[str] = []
    for package in table.values():
        for text in monorepo.sibling_requirements(package, table):
            requirement = Requirement(text)
            sibling = table[monorepo.canonical(requirement.name)]
            where = f"{package.name} requires {text!r}"
            if requirement.url:
                problems.append(f"{where}: a URL or path requirement cannot be published")
                continue
            version = Version(sibling.version)
            if not requirement.specifier.contains(version, prereleases=True):
                problems.append(
                    f"{where}, which excludes the current {sibling.name} {sibling.version}"
                )
            if not any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier):
                problems.append(f"{where}: the range has no upper bound")
            print(f"ok  {package.name}: {text}  (current {sibling.name} {sibling.version})")
    return problems


def closure_problems(table: dict[str, monorepo.Package], expected: list[str]) -> list[str]:
    problems = []
    for item in expected:
        name, _, deps = item.partition("=")
        want = {monorepo.canonical(d) for d in deps.split(",") if d}
        have = set(monorepo.sibling_closure(name, table))
        if want != have:
            problems.append(
                f"{name}: pyproject.toml depends on siblings {sorted(have)}, "
                f"the noxfile expects {sorted(want)}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="NAME=DEP,DEP",
        help="the siblings NAME must depend on, directly or not",
    )
    args = parser.parse_args(argv)
    table = monorepo.packages()
    problems = range_problems(table) + closure_problems(table, args.expect)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
