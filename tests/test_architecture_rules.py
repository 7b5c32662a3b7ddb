"""The rules of docs/architecture.md that are about how the code flows, not where it is.

- Planning keeps no state on the parallelizer: discovery is a value
  (``multimodal_fsdp.model_discovery.Discovery``) that the planning hooks read from the
  plan context, so one parallelizer can plan several models (or threads) at once.
- One sharding path: torch's ``fully_shard`` is called in one function
  (``fsdp_core.sharding.shard_units``), which the entry points call directly with
  checked units: a plan's (``apply_plan``, ``parallelize``) or one module's own
  (``_fully_shard_module`` and the free functions, ``fsdp_core.shard_calls.group_units``),
  both made from planned calls by ``fsdp_core.shard_calls.call_units``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_core.plan_context import PlanContext
from model_deepseek_v41 import DeepseekV41Config, build_deepseek_v41
from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer
from multimodal_fsdp import MultimodalParallelizer

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "packages").glob("*/src/**/*.py"))


def _callers(name: str) -> list[str]:
    """``module:function`` of every call of ``name`` (a bare name or an attribute) in
    the packages' sources."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = path.relative_to(next(p for p in path.parents if p.name == "src")).as_posix()
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and _called(node.func) == name:
                    found.append(f"{module}:{function.name}")
    return sorted(set(found))


def _called(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def test_fully_shard_has_one_call_site_and_the_entry_points_call_it() -> None:
    assert _callers("fully_shard") == ["fsdp_core/sharding.py:shard_units"]
    assert _callers("shard_units") == [
        "fsdp_core/dtype_units.py:fully_shard_dtype_safe",
        "fsdp_core/dtype_units.py:shard_groups_then_module",
        "fsdp_core/parallelizer.py:_apply",
        "fsdp_core/parallelizer.py:_fully_shard_module",
        "fsdp_core/sharding.py:apply_fully_shard",
    ]
    assert _callers("call_units") == [
        "fsdp_core/parallelizer.py:_apply",
        "fsdp_core/shard_calls.py:group_units",
    ]


def _tiny(*, frozen_tower: bool) -> nn.Module:
    model = build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)
    if frozen_tower:
        model.vision.requires_grad_(False)
    return model


def _watching(cls: type[MultimodalParallelizer]) -> type[MultimodalParallelizer]:
    """``cls`` that copies its own attributes while a plan is being made (from a
    planning hook that runs after the calls are planned)."""

    class Watching(cls):  # type: ignore[valid-type,misc]
        seen: list[dict[str, Any]]

        def _plan_notes(self, ctx: PlanContext) -> list[str]:
            type(self).seen.append(dict(vars(self)))
            return list(super()._plan_notes(ctx))

    Watching.seen = []
    return Watching


@pytest.mark.parametrize("base", [MultimodalParallelizer, DeepseekV41ModelParallelizer])
@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_planning_leaves_the_parallelizer_as_it_was(
    base: type[MultimodalParallelizer], policy: str
) -> None:
    cls = _watching(base)
    parallelizer = cls(frozen_multimodal_sharding=policy, balance_media=policy != "replicate")
    before = dict(vars(parallelizer))
    for frozen in (True, False):
        parallelizer.plan(_tiny(frozen_tower=frozen))
    assert cls.seen == [before, before]  # type: ignore[attr-defined]
    assert vars(parallelizer) == before
