"""Signatures the docs write out are the real ones.

Where a page introduces ``apply_plan`` it gives the whole signature, of the
parallelizer's method and of the free ``fsdp_core.parallelizer.apply_plan`` (issue 24),
and every ``plan(model, *, ...)`` / ``parallelize(model, *, ...)`` / ``apply_plan(model,
plan, *, ...)`` a page writes out matches the code, so a changed parameter cannot leave a
page behind.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsdp_core.parallelizer import ModelParallelizer, apply_plan

ROOT = Path(__file__).resolve().parents[1]

#: The pages that introduce ``apply_plan`` to a reader.
INTRODUCING = ("docs/training-loops.md", "packages/fsdp-core/README.md")
INTRODUCING += ("packages/multimodal-fsdp/README.md",)

#: A written-out signature: the name, then ``(model, ...)`` with a keyword-only ``*``.
_WRITTEN = re.compile(r"\b(apply_plan|plan|parallelize)\((model, [^()]*\*[^()]*)\)")


def _as_written(function: Callable[..., Any]) -> str:
    """``function``'s parameters as the docs write them: no ``self``, no annotations."""
    signature = inspect.signature(function)
    parameters = [
        parameter.replace(annotation=inspect.Parameter.empty)
        for parameter in signature.parameters.values()
        if parameter.name != "self"
    ]
    bare = signature.replace(parameters=parameters, return_annotation=inspect.Parameter.empty)
    return str(bare)[1:-1]


REAL = {
    "apply_plan": _as_written(apply_plan),
    "plan": _as_written(ModelParallelizer.plan),
    "parallelize": _as_written(ModelParallelizer.parallelize),
}


def _text(page: str) -> str:
    """The page with its lines joined, so a signature wrapped over lines reads whole."""
    return " ".join((ROOT / page).read_text(encoding="utf-8").split())


def test_the_method_and_the_free_function_take_the_same_parameters() -> None:
    assert _as_written(ModelParallelizer.apply_plan) == REAL["apply_plan"]
    assert REAL["apply_plan"] == "model, plan, *, mesh, offload_policy=None, dp_dims=None"


@pytest.mark.parametrize("page", INTRODUCING)
def test_pages_that_introduce_apply_plan_give_its_signature(page: str) -> None:
    text = _text(page)
    assert f"apply_plan({REAL['apply_plan']})" in text
    assert f"fsdp_core.parallelizer.apply_plan({REAL['apply_plan']})" in text


def _pages() -> list[str]:
    found = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
    # Changelogs keep the signatures of their time: not checked.
    return found + sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("packages/*/README.md"))


@pytest.mark.parametrize("page", _pages())
def test_every_written_out_signature_matches_the_code(page: str) -> None:
    for name, written in _WRITTEN.findall(_text(page)):
        assert written == REAL[name], f"{page}: {name}({written}) but the code has {REAL[name]}"
