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
TRANSFORMERS_SPEC = os.environ.get("FSDP_TRANSFORMERS_SPEC", "transformers>=5,<6")

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
    session.install(*_package_paths(package, *PACKAGES[package]))
    session.run("python", "-m", "pytest", f"packages/{package}/tests", *session.posargs)


@nox.session(python=PYTHON, tags=["ci"])
def integration(session: nox.Session) -> None:
    """All packages together, plus transformers, running the cross-package tests."""
    _install_torch(session)
    session.install(*TEST_DEPS, TRANSFORMERS_SPEC)
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
def demo(session: nox.Session) -> None:
    """The main job: what exists of the product, run end to end."""
    _install_torch(session)
    session.install(*_package_paths(*PACKAGES))
    session.run("python", "-c", "import fsdp_core; print(fsdp_core.compat.capabilities())")
