"""Every developer and CI task of the monorepo, as nox sessions.

torch is installed from one place, ``TORCH_SPEC`` below (default
``torch==2.13.0``, override with the ``FSDP_TORCH_SPEC`` environment variable),
before any package, so no package's ``torch>=...`` range pulls another build.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent

TORCH_SPEC = os.environ.get("FSDP_TORCH_SPEC", "torch==2.13.0")
PYTHON = os.environ.get("FSDP_PYTHON", "3.11")

#: Distributions, lowest layer first, with the sibling distributions each declares.
PACKAGES: dict[str, tuple[str, ...]] = {
    "fsdp-core": (),
    "multimodal-fsdp": ("fsdp-core",),
    "model-deepseek-v41": ("multimodal-fsdp", "fsdp-core"),
}
TEST_DEPS = ("pytest>=8", "numpy")
#: Optional extras a package's own tests exercise (installed with the package).
TEST_EXTRAS: dict[str, str] = {"fsdp-core": "hf"}
#: The transformers release the integration tests are pinned to (its model-type lists are
#: checked exactly); FSDP_TRANSFORMERS_SPEC tries another (they still run, the exact
#: lists skip).
TRANSFORMERS_SPEC = os.environ.get("FSDP_TRANSFORMERS_SPEC", "transformers>=5.24,<5.25")
#: What the cross-package tests add: real transformers VLMs and PEFT's LoRA, Lightning,
#: and for the Trainer/TRL/accelerate adapters accelerate, TRL and datasets (none of them
#: replaces the torch installed first).
INTEGRATION_DEPS = (
    TRANSFORMERS_SPEC,
    "peft>=0.13",
    "lightning>=2.4,<3",
    "accelerate>=1.16,<2",
    "trl>=1.16,<2",
    "datasets>=3",
)
#: torchtitan and the two packages it needs to import, installed without dependencies:
#: its declared requirements pull data and logging stacks the tests do not use.
TORCHTITAN_NO_DEPS = ("torchtitan>=0.3,<0.4", "spmd_types==0.2.3")
#: tyro is imported by torchtitan's configs; its own small dependencies come with it.
TORCHTITAN_DEPS = ("tyro>=0.9",)

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = False
nox.options.sessions = ["lint", "typecheck", "tests", "integration", "build"]


def _install_torch(session: nox.Session) -> None:
    session.install(TORCH_SPEC)


def _package_paths(*names: str) -> list[str]:
    return [str(ROOT / "packages" / name) for name in names]


@nox.session(python=PYTHON, tags=["ci"])
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package alone: torch, that package and the siblings it declares, its tests."""
    _install_torch(session)
    session.install(*TEST_DEPS)
    extra = TEST_EXTRAS.get(package)
    own = _package_paths(package)[0] + (f"[{extra}]" if extra else "")
    session.install(own, *_package_paths(*PACKAGES[package]))
    session.run("python", "-m", "pytest", f"packages/{package}/tests", *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def integration(session: nox.Session) -> None:
    """All packages together, plus transformers, running the cross-package tests."""
    _install_torch(session)
    session.install(*TEST_DEPS, *INTEGRATION_DEPS)
    session.install("--no-deps", *TORCHTITAN_NO_DEPS)
    session.install(*TORCHTITAN_DEPS)
    session.install(*_package_paths(*PACKAGES))
    session.run("python", "-m", "pytest", "tests", *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's sources."""
    _install_torch(session)
    session.install("mypy>=1.10", "numpy")
    session.install("--no-deps", *_package_paths(*PACKAGES))
    session.run(
        "mypy",
        "--strict",
        *(f"packages/{name}/src" for name in PACKAGES),
    )


@nox.session(python=PYTHON, tags=["ci"])
def build(session: nox.Session) -> None:
    """Wheel and sdist of every package with hatch, then a metadata check."""
    session.install("hatch>=1.12", "twine>=5")
    out = ROOT / "dist"
    for name in PACKAGES:
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        session.chdir(ROOT / "packages" / name)
        session.run("hatch", "build", "-t", "wheel", "-t", "sdist", str(target))
        session.chdir(ROOT)
        session.run("twine", "check", "--strict", *(str(p) for p in sorted(target.iterdir())))


@nox.session(python=PYTHON)
def distributed_nccl(session: nox.Session) -> None:
    """The multi-process suite under NCCL (skips with a message without enough GPUs).

    Needs a CUDA build of torch: e.g. ``FSDP_TORCH_SPEC="torch==2.13.0" PIP_INDEX_URL=...``
    on a GPU host. World size 1 runs with one GPU; 2 and 4 need as many GPUs.
    """
    _install_torch(session)
    session.install(*TEST_DEPS, *INTEGRATION_DEPS)
    session.install(*_package_paths(*PACKAGES))
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "distributed",
        "-rs",
        "tests",
        *session.posargs,
        env={"FSDP_TEST_BACKEND": "nccl"},
    )


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: train DeepSeek-V4.1 with FSDP2 on torchrun ranks, check a reference.

    Options after ``--``: --policy root|per_layer|replicate, --nproc N, --steps N,
    --precision bf16|fp32, --size tiny|small|base (``nox -s demo -- --help``).
    """
    _install_torch(session)
    session.install("numpy")  # torch warns at import without it
    session.install(*_package_paths(*PACKAGES))
    session.run("python", "-m", "model_deepseek_v41.demo", *session.posargs)


# --------------------------------------------------------------- releases and documentation
# Release tooling lives in tools/ (see docs/releasing.md); these sessions only call it.

TOOLS = ROOT / "tools"
DIST = ROOT / "dist"
RELEASE_TOOLS = ("hatch>=1.12", "twine>=5")
DOCS_DEPS = (
    "mkdocs>=1.6,<2",
    "mkdocs-material>=9.5,<10",
    "mkdocstrings[python]>=0.27",
    "ruff>=0.6",  # formats the signatures on the API pages
)


def _release_posargs(session: nox.Session) -> tuple[str, str | None]:
    """``<package> [--tag <package>-vX.Y.Z]`` from the command line."""
    args = list(session.posargs)
    tag = None
    if "--tag" in args:
        index = args.index("--tag")
        if index + 1 >= len(args):
            session.error("--tag needs a value, e.g. --tag multimodal-fsdp-v0.2.0")
        tag = args[index + 1]
        del args[index : index + 2]
    if len(args) != 1 or args[0] not in PACKAGES:
        session.error(
            f"usage: nox -s release -- <package> [--tag <package>-vX.Y.Z]; "
            f"packages: {', '.join(PACKAGES)}"
        )
    return args[0], tag


def _build_tools(session: nox.Session) -> Path:
    """A separate environment with hatch and twine, so the one under test holds only
    what the package declares. Returns its ``bin`` directory (reused between runs)."""
    venv = Path(session.create_tmp()).resolve() / "build-tools"
    bin_dir = venv / "bin"
    if not (bin_dir / "twine").exists() or not (bin_dir / "hatch").exists():
        session.run("python", "-m", "venv", "--clear", str(venv))
        session.run(
            str(bin_dir / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            *RELEASE_TOOLS,
            external=True,
        )
    return bin_dir


def _build_package(session: nox.Session, tools: Path, name: str) -> None:
    """Wheel and sdist of one package into dist/<name>/, then twine's strict check."""
    target = DIST / name
    shutil.rmtree(target, ignore_errors=True)
    session.chdir(ROOT / "packages" / name)
    session.run(
        str(tools / "hatch"), "build", "-t", "wheel", "-t", "sdist", str(target), external=True
    )
    session.chdir(ROOT)
    session.run(
        str(tools / "twine"),
        "check",
        "--strict",
        *(str(p) for p in sorted(target.iterdir())),
        external=True,
    )


@nox.session(python=PYTHON)
def release(session: nox.Session) -> None:
    """Build one package and its lower layers, then test the built wheel in this clean venv.

    ``nox -s release -- <package> [--tag <package>-vX.Y.Z]``. With ``--tag`` (the
    release workflow) it also checks the tag against the version, the CHANGELOG and
    the package index. Nothing is published here.
    """
    import hashlib
    import json

    package, tag = _release_posargs(session)
    siblings = PACKAGES[package]
    tools = _build_tools(session)
    tools_python = str(tools / "python")
    if tag is not None:
        session.run(
            tools_python,
            str(TOOLS / "release_check.py"),
            "tag",
            tag,
            "--package",
            package,
            external=True,
        )
    session.run(tools_python, str(TOOLS / "check_ranges.py"), external=True)

    # 1. Artefacts: the package and every sibling it needs, built from this tree.
    for name in (*reversed(siblings), package):
        _build_package(session, tools, name)
    report_file = Path(session.create_tmp()).resolve() / "artefacts.json"
    session.run(
        tools_python,
        str(TOOLS / "release_check.py"),
        "artefacts",
        package,
        "--dist",
        str(DIST),
        "--out",
        str(report_file),
        external=True,
    )
    report = json.loads(report_file.read_text())

    # 2. This session's venv is the clean one: torch first, the other declared
    #    requirements from the index, then the wheels with the index off, so a
    #    sibling can only come from dist/ and only through the declared ranges.
    session.run("python", "-m", "pip", "uninstall", "--yes", "--quiet", *PACKAGES, silent=True)
    _install_torch(session)
    if report["external_requirements"]:
        session.install(*report["external_requirements"])
    find_links = [arg for name in siblings for arg in ("--find-links", str(DIST / name))]
    session.install("--no-index", *find_links, report["wheels"][package])
    session.run("python", "-m", "pip", "check")
    expected = [f"{item['name']}={item['version']}" for item in report["artefacts"]]
    session.run("python", "-I", str(TOOLS / "release_check.py"), "installed", package, *expected)

    # 3. The package's own tests and API snapshot, against the installed wheel,
    #    from outside the source tree.
    session.install(*TEST_DEPS)
    session.run("python", "-I", str(TOOLS / "api_snapshot.py"), "--check", package)
    session.chdir(session.create_tmp())
    session.run(
        "python",
        "-I",
        "-m",
        "pytest",
        str(ROOT / "packages" / package / "tests"),
        "-c",
        str(ROOT / "pyproject.toml"),
        "--rootdir",
        str(ROOT),
        "--import-mode=importlib",
        "-p",
        "no:cacheprovider",
        "-q",
    )
    session.chdir(ROOT)

    # 4. What was built.
    for item in report["artefacts"]:
        for key in ("wheel", "sdist"):
            path = Path(item[key])
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            session.log(
                f"{item['name']} {item['version']}: {path} ({path.stat().st_size:,} bytes, "
                f"sha256 {digest[:16]}…)"
            )
    session.log(
        f"release check of {package} passed; tag: {package}-v{report['artefacts'][0]['version']}"
    )


@nox.session(python=PYTHON)
def bump(session: nox.Session) -> None:
    """``nox -s bump -- <package> <major|minor|patch|X.Y.Z>``: version, CHANGELOG, snapshot."""
    if len(session.posargs) < 2:
        session.error("usage: nox -s bump -- <package> <major|minor|patch|X.Y.Z> [--date D]")
    session.install("hatch>=1.12", "packaging>=24")
    session.run("python", str(TOOLS / "bump.py"), *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def check_ranges(session: nox.Session) -> None:
    """Each package's range of a sibling admits the sibling's current version."""
    session.install("packaging>=24")
    session.run(
        "python",
        str(TOOLS / "check_ranges.py"),
        *(f"--expect={name}={','.join(deps)}" for name, deps in PACKAGES.items()),
    )


@nox.session(python=PYTHON)
def api_snapshot(session: nox.Session) -> None:
    """Rewrite packages/*/api-snapshot.json from the code (``-- --check`` only checks)."""
    _install_torch(session)
    session.install("packaging>=24")
    session.install(*_package_paths(*PACKAGES))
    session.run("python", str(TOOLS / "api_snapshot.py"), *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def docs(session: nox.Session) -> None:
    """The documentation site into site/ (MkDocs, API pages from docstrings); warnings fail.

    The code examples of the pages run in ``tests/test_docs_examples.py``.
    """
    session.install(*DOCS_DEPS)
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(ROOT / "site"),
        *session.posargs,
        env={"NO_MKDOCS_2_WARNING": "1"},
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark: collectives, memory and time of each sharding plan (docs/benchmark.md)."""
    _install_torch(session)
    session.install(*_package_paths(*PACKAGES))
    session.install("matplotlib")  # the memory-timeline chart; a benchmark-only dependency
    session.run("python", "benchmarks/bench.py", *session.posargs)


@nox.session(python=PYTHON)
def exit_check(session: nox.Session) -> None:
    """Launch finished torchrun jobs many times and count the aborts on the way out.

    ``nox -s exit_check -- --launches 100`` runs the LoRA + balance_media + export +
    generate + DCP job, a job ending right after a collective, and the getting-started
    page (``-- --help`` for the choices); not a CI test. See docs/benchmark.md.
    """
    _install_torch(session)
    session.install("numpy", "pytest>=8", *INTEGRATION_DEPS)  # pytest: the docs-page parser
    session.install(*_package_paths(*PACKAGES))
    session.run("python", "benchmarks/exit_check.py", *session.posargs)
