"""Runtime hooks are objects: each package declares its own, with the internals they read
and their plan data computed once; nothing sets another object's private fields.

Issue 18 ("Hooks become objects"). The layout test shards under the single-process
``fake`` backend (exact collectives, meaningless numbers).
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vlm import build_vlm, vlm_batches, vlm_loss  # tests/mp, on sys.path (conftest)

import fsdp_core
import fsdp_core.hook_planning
from fsdp_core import build_mesh, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from fsdp_core.runtime import installed_hooks
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.runtime import schedule_check as uneven_module

ROOT = Path(__file__).resolve().parents[1]

#: Private attributes of objects of another class that a module may set, with the reason.
ALLOWED_PRIVATE_WRITES: dict[str, str] = {
    # torch's own nn.Module registries, edited to swap submodules and tensors in place
    # (LoRA unwrapping, checkpoint materialisation); private torch access is policed by
    # its own test, not by this one.
    "_modules": "nn.Module's submodule registry",
    "_parameters": "nn.Module's parameter registry",
    "_buffers": "nn.Module's buffer registry",
}

MULTIMODAL_HOOKS = ("schedule_check", "prefetch_guard", "balance_media")


def test_fsdp_core_names_no_multimodal_hook() -> None:
    """Core defines the hook protocol; the multimodal package declares its own hooks."""
    offenders = []
    src = Path(inspect.getfile(fsdp_core)).parent
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        offenders += [
            f"{path.relative_to(src)}: {name}" for name in MULTIMODAL_HOOKS if name in text
        ]
    assert offenders == [], offenders


def _private_writes(path: Path) -> list[str]:
    """``<name>._<attr> = ...`` (also ``+=``, annotated) and ``<name>._<attr>.<method>(...)``
    where ``<name>`` is not ``self``/``cls``: a module filling in another object's state."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [node.func.value]
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr.startswith("_")
                and not target.attr.startswith("__")
                and target.attr not in ALLOWED_PRIVATE_WRITES
                and isinstance(target.value, ast.Name)
                and target.value.id not in ("self", "cls")
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)}")
    return found


def test_no_module_sets_private_fields_of_other_objects() -> None:
    """Constructors take what an object needs; factories do not fill in private fields."""
    offenders = [
        line
        for path in sorted(ROOT.glob("packages/*/src/**/*.py"))
        for line in _private_writes(path)
    ]
    assert offenders == [], "\n".join(offenders)


# --- the schedule layout is computed once -----------------------------------------------------


@pytest.fixture
def fake2() -> Iterator[None]:
    with fake_process_group(2):
        yield


@pytest.fixture
def layout_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of ``plan_schedule_layout`` wherever a multimodal module imported it."""
    original: Callable[..., Any] = uneven_module.plan_schedule_layout
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if (
            name.startswith("multimodal_fsdp")
            and getattr(module, "plan_schedule_layout", None) is original
        ):
            monkeypatch.setattr(module, "plan_schedule_layout", counting)
    return calls


@pytest.fixture
def owner_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of ``entry_owners`` (the ``entry_unshard`` hook's data) by the parallelizer."""
    original: Callable[..., Any] = fsdp_core.hook_planning.entry_owners
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fsdp_core.hook_planning, "entry_owners", counting)
    return calls


def test_hook_data_is_computed_once_per_plan(
    fake2: None, layout_calls: list[int], owner_calls: list[int]
) -> None:
    """The schedule layout and the entry modules' owning units: planned once, installed as is."""
    model = build_vlm(dtype=torch.float32, frozen_tower=True)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding="per_layer")
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("fp32", "fp32"))
    assert {"schedule_check", "entry_unshard"} <= set(plan.hook_names())
    assert (len(layout_calls), len(owner_calls)) == (1, 1)
    parallelizer.apply_plan(model, plan, mesh=build_mesh())
    assert {"schedule_check", "entry_unshard"} <= set(installed_hooks(model))
    assert (len(layout_calls), len(owner_calls)) == (1, 1), "apply_plan computed hook data again"


def test_the_schedule_layout_is_computed_once_per_plan(
    fake2: None, layout_calls: list[int]
) -> None:
    model = build_vlm(dtype=torch.float32, frozen_tower=True)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding="per_layer")
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("fp32", "fp32"))
    assert "schedule_check" in plan.hook_names()
    assert len(layout_calls) == 1
    parallelizer.apply_plan(model, plan, mesh=build_mesh())
    assert "schedule_check" in installed_hooks(model)
    assert len(layout_calls) == 1, "apply_plan computed the schedule layout again"
    vlm_loss(model, vlm_batches(1, 1)[0][0]).backward()
