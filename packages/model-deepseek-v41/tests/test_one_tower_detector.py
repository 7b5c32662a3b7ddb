"""One vision-tower detector: the fp32-norm planning of DeepSeek-V4.1 reads the towers
of the multimodal discovery that ``plan()`` made (so ``exclude=`` and
``extra_tower_names=`` apply to it too), discovery runs once per ``plan()`` and never in
``apply_plan()``, and ``fully_shard_deepseek_v41`` plans the norm units with the same code.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

import model_deepseek_v41.fsdp as deepseek_fsdp
import multimodal_fsdp.model_discovery as discovery_module
from fsdp_core import ShardingPlan, build_mesh, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from model_deepseek_v41 import (
    PARALLELIZER,
    DeepseekV41Config,
    DeepseekV41ModelParallelizer,
    build_deepseek_v41,
    fully_shard_deepseek_v41,
)
from model_deepseek_v41.layers import RMSNorm
from multimodal_fsdp.discovery import resolve_multimodal_modules

MP = mixed_precision_policy("bf16", "fp32")


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


def _model(*, frozen_tower: bool = False) -> nn.Module:
    model = build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)
    if frozen_tower:
        model.vision.requires_grad_(False)
    return model


def _renamed(tower_name: str) -> nn.Module:
    """The tiny model's parts with the tower under a name discovery does not know."""
    tiny = _model()
    holder = nn.Module()
    holder.add_module(tower_name, tiny.vision)
    holder.add_module("aligner", tiny.aligner)
    holder.add_module("model", tiny.model)
    return holder


def _vision_towers(parallelizer: DeepseekV41ModelParallelizer, model: nn.Module) -> list[str]:
    return [
        part.found.path
        for part in parallelizer.multimodal_parts(model)
        if part.found.role == "tower" and part.found.modality == "vision"
    ]


def _norms_under(model: nn.Module, towers: list[str]) -> set[str]:
    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, RMSNorm) and any(name.startswith(f"{t}.") for t in towers)
    }


def _norm_unit_paths(plan: ShardingPlan) -> set[str]:
    return {path for unit in plan.units if unit.role == "fp32_norms" for path in unit.paths}


CASES = {
    "reference": (lambda: _model(), {}),
    "excluded-tower": (lambda: _model(), {"exclude": ("vision",)}),
    "unknown-name": (lambda: _renamed("pixel_trunk"), {}),
    "extra-tower-name": (lambda: _renamed("pixel_trunk"), {"extra_tower_names": ("pixel_trunk",)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_norm_units_follow_the_plans_discovery(case: str) -> None:
    """The fp32-norm units are exactly the norms of the towers discovery found."""
    factory, options = CASES[case]
    model = factory()
    parallelizer = DeepseekV41ModelParallelizer(**options)  # type: ignore[arg-type]
    plan = parallelizer.plan(model, mp_policy=MP)
    towers = _vision_towers(parallelizer, model)
    assert _norm_unit_paths(plan) == _norms_under(model, towers)
    assert bool(towers) == (case in ("reference", "extra-tower-name"))


def test_an_excluded_frozen_tower_has_no_replicated_norms() -> None:
    """Frozen norms are replicated only for towers the plan's discovery found."""
    model = _model(frozen_tower=True)
    plan = DeepseekV41ModelParallelizer(exclude=("vision",)).plan(model, mp_policy=MP)
    assert plan.replicated_param_names == ()
    assert _norm_unit_paths(plan) == set()


@pytest.fixture
def detector_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every tower detection, by the discovery of either package or by structure."""
    calls: list[str] = []

    def counting_discovery(where: str) -> object:
        def counting(model: nn.Module, **kwargs: object) -> object:
            calls.append(where)
            return resolve_multimodal_modules(model, **kwargs)  # type: ignore[arg-type]

        return counting

    monkeypatch.setattr(
        discovery_module, "resolve_multimodal_modules", counting_discovery("multimodal")
    )
    monkeypatch.setattr(
        deepseek_fsdp,
        "resolve_multimodal_modules",
        counting_discovery("deepseek"),
        raising=False,
    )
    for name in ("find_vision_towers", "is_vision_tower", "vision_norm_paths"):
        original = getattr(deepseek_fsdp, name, None)
        if original is None:
            continue

        def structural(*args: object, _name: str = name, _orig: object = original) -> object:
            calls.append(_name)
            return _orig(*args)  # type: ignore[operator]

        monkeypatch.setattr(deepseek_fsdp, name, structural)
    return calls


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
@pytest.mark.parametrize("frozen", [False, True])
def test_one_detector_per_plan_and_none_in_apply_plan(
    policy: str, frozen: bool, detector_calls: list[str]
) -> None:
    model = _model(frozen_tower=frozen)
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
    plan = parallelizer.plan(model, mp_policy=MP)
    assert [c for c in detector_calls if c != "vision_norm_paths"] == ["multimodal"]
    detector_calls.clear()
    with fake_process_group(2):
        parallelizer.apply_plan(model, plan, mesh=build_mesh())
    assert detector_calls == []


def test_the_function_on_a_whole_model_makes_the_planned_norm_units(mesh: DeviceMesh) -> None:
    """On the whole model the function finds the tower with the multimodal discovery and
    makes the fp32-norm units the parallelizer plans for that model, then the model."""
    model = _model()
    plan = PARALLELIZER.plan(model, mp_policy=MP)
    planned = sorted(tuple(sorted(u.paths)) for u in plan.units if u.role == "fp32_norms")
    assert planned
    fully_shard_deepseek_v41(model, mesh, MP)
    states: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            states.setdefault(id(module._get_fsdp_state()), []).append(name)
    made = sorted(tuple(sorted(names)) for names in states.values())
    assert made == sorted([*planned, ("",)])
