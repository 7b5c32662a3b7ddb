"""Checks of the release pipeline (``nox -s release``); each subcommand is one step.

``artefacts PACKAGE``
    Run with the build tools. Finds the wheel and sdist of PACKAGE and of the
    siblings it depends on in ``dist/<name>/``, checks that their metadata
    carries the source version, and writes JSON (``--out``, else stdout): the
    wheels, and the requirements that are not siblings (installed from the
    package index).

``installed PACKAGE NAME=VERSION ...``
    Run with the clean environment's interpreter (``python -I``). The
    monorepo distributions installed there must be exactly the NAME=VERSION
    pairs (so installing fsdp-core alone pulled nothing else, and
    model-deepseek-v41 pulled both lower layers); each import package must
    come from site-packages, not from ``packages/*/src``; every public module
    of PACKAGE must import with only the declared dependencies present.

``tag TAG``
    The tag of a release, ``<package>-vX.Y.Z``: the version must be the
    package's, the CHANGELOG must list it (and nothing left under
    Unreleased), and the version must not exist on the package index yet
    (``RELEASE_INDEX_URL``, default https://pypi.org/pypi).
"""

from __future__ import annotations

import argparse
import email.parser
import importlib
import importlib.metadata
import json
import os
import pkgutil
import sys
import sysconfig
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import monorepo

INDEX_URL = os.environ.get("RELEASE_INDEX_URL", "https://pypi.org/pypi")


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode("utf-8"))


def _sdist_metadata(sdist: Path) -> email.message.Message:
    with tarfile.open(sdist) as archive:
        member = next(
            m
            for m in archive.getmembers()
            if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
        )
        handle = archive.extractfile(member)
        assert handle is not None
        return email.parser.Parser().parsestr(handle.read().decode("utf-8"))


def _only(paths: list[Path], what: str, directory: Path) -> Path:
    if len(paths) != 1:
        raise SystemExit(f"expected one {what} in {directory}, found {[p.name for p in paths]}")
    return paths[0]


def artefacts(package_name: str, dist: Path) -> dict[str, object]:
    from packaging.requirements import Requirement

    table = monorepo.packages()
    names = [monorepo.canonical(package_name), *monorepo.sibling_closure(package_name, table)]
    wheels: dict[str, str] = {}
    external: list[str] = []
    report = []
    for name in names:
        package = table[name]
        directory = dist / name
        wheel = _only(sorted(directory.glob("*.whl")), "wheel", directory)
        sdist = _only(sorted(directory.glob("*.tar.gz")), "sdist", directory)
        for path, meta in ((wheel, _wheel_metadata(wheel)), (sdist, _sdist_metadata(sdist))):
            if monorepo.canonical(meta["Name"]) != name or meta["Version"] != package.version:
                raise SystemExit(
                    f"{path.name} says {meta['Name']} {meta['Version']}, the source says "
                    f"{name} {package.version}"
                )
        for text in _wheel_metadata(wheel).get_all("Requires-Dist") or []:
            requirement = Requirement(text)
            if requirement.marker is not None and "extra" in str(requirement.marker):
                continue  # optional extras are not installed by a plain install
            if monorepo.canonical(requirement.name) in table:
                if requirement.url:
                    raise SystemExit(f"{wheel.name} requires {text!r}: a path or URL")
                continue
            if text not in external:
                external.append(text)
        wheels[name] = str(wheel)
        report.append(
            {"name": name, "version": package.version, "wheel": str(wheel), "sdist": str(sdist)}
        )
    return {"wheels": wheels, "external_requirements": external, "artefacts": report}


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def installed(package_name: str, expected: dict[str, str]) -> list[str]:
    table = monorepo.packages()
    problems: list[str] = []
    present = {}
    for dist in importlib.metadata.distributions():
        name = monorepo.canonical(dist.metadata["Name"])
        if name in table:
            present[name] = dist.version
    if present != expected:
        problems.append(f"monorepo distributions installed: {present}; expected exactly {expected}")
    site_dirs = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    for name in sorted(present):
        import_name = table[name].import_name
        module = importlib.import_module(import_name)
        location = Path(module.__file__ or "")
        if _inside(location, monorepo.PACKAGES_DIR) or not any(
            _inside(location, site) for site in site_dirs
        ):
            problems.append(f"{import_name} imports from {location}, not from site-packages")
        else:
            print(f"ok  {name} {present[name]}: {import_name} from {location.parent}")
    target = importlib.import_module(table[monorepo.canonical(package_name)].import_name)
    count = 0
    for info in pkgutil.walk_packages(target.__path__, prefix=f"{target.__name__}."):
        if info.name.rpartition(".")[2] == "__main__":
            continue  # importing it would run the command line
        importlib.import_module(info.name)
        count += 1
    print(f"ok  {target.__name__} and its {count} submodules import with the declared dependencies")
    return problems


def published(name: str, version: str) -> bool:
    url = f"{INDEX_URL.rstrip('/')}/{name}/{version}/json"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return bool(response.status == 200)
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return False
        raise SystemExit(
            f"cannot tell whether {name} {version} is published ({url}): {error}"
        ) from None
    except urllib.error.URLError as error:
        raise SystemExit(f"cannot reach {url} to check for an existing release: {error}") from None


def tag_problems(tag: str, package_name: str | None = None) -> list[str]:
    table = monorepo.packages()
    matches = [p for p in table.values() if tag.startswith(p.tag_prefix)]
    # "model-deepseek-v41-v1.0.0" also starts with no shorter prefix, but be exact anyway:
    package = max(matches, key=lambda p: len(p.tag_prefix), default=None)
    if package is None:
        return [f"tag {tag!r} is not <package>-vX.Y.Z for any of {', '.join(table)}"]
    if package_name is not None and package.name != monorepo.canonical(package_name):
        return [f"tag {tag!r} belongs to {package.name}, not to {package_name}"]
    version = tag.removeprefix(package.tag_prefix)
    problems = []
    if version != package.version:
        problems.append(
            f"tag {tag} says {version} but {package.about_file.name} says {package.version}: "
            f"bump first (`nox -s bump -- {package.name} {version}`)"
        )
    changelog = package.changelog.read_text(encoding="utf-8")
    problems += [
        f"{package.changelog.relative_to(monorepo.ROOT)}: {p}"
        for p in monorepo.changelog_problems(
            changelog, version, for_release=True, package=package.name
        )
    ]
    if published(package.name, version):
        problems.append(f"{package.name} {version} is already on {INDEX_URL}: a release is final")
    else:
        print(f"ok  {package.name} {version} is not on {INDEX_URL} yet")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_art = sub.add_parser("artefacts")
    p_art.add_argument("package")
    p_art.add_argument("--dist", type=Path, default=monorepo.ROOT / "dist")
    p_art.add_argument("--out", type=Path, help="write the JSON here instead of stdout")
    p_inst = sub.add_parser("installed")
    p_inst.add_argument("package")
    p_inst.add_argument("expect", nargs="+", metavar="NAME=VERSION")
    p_tag = sub.add_parser("tag")
    p_tag.add_argument("tag")
    p_tag.add_argument("--package")
    args = parser.parse_args(argv)

    if args.command == "artefacts":
        text = json.dumps(artefacts(args.package, args.dist), indent=2)
        if args.out is None:
            print(text)
        else:
            args.out.write_text(text, encoding="utf-8")
        return 0
    if args.command == "installed":
        expected = dict(item.split("=", 1) for item in args.expect)
        problems = installed(args.package, expected)
    else:
        problems = tag_problems(args.tag, args.package)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
