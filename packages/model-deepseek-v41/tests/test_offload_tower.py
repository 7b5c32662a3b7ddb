"""Offloading the DeepSeek-V4.1 vision tower (``offload={"tower": ...}``): its fp32 norm
units belong to the tower, so they are offloaded with it; frozen norms, which the
parallelizer keeps whole on every rank, stay on the device."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy

from fsdp_core import build_mesh, internals, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from model_deepseek_v41 import DeepseekV41Config, DeepseekV41ModelParallelizer, build_deepseek_v41

CPU = CPUOffloadPolicy(pin_memory=False)
MP = mixed_precision_policy("bf16", "fp32")


@pytest.fixture
def mesh2() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


def tower_parallelizer() -> DeepseekV41ModelParallelizer:
    return DeepseekV41ModelParallelizer(
        frozen_multimodal_sharding="per_layer", offload={"tower": CPU}
    )


def test_the_fp32_norm_units_of_a_trainable_tower_are_offloaded_with_it() -> None:
    model = build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)
    plan = tower_parallelizer().plan(model, mp_policy=MP)
    norms = [unit for unit in plan.units if unit.role == "fp32_norms"]
    assert norms
    for unit in plan.units:
        in_tower = all(path.startswith("vision") for path in unit.paths)
        assert (unit.offload_policy is not None) == in_tower, unit.label
    assert all(unit.offload_policy == CPU for unit in norms)


def test_frozen_norms_stay_on_the_device_beside_an_offloaded_frozen_tower(
    mesh2: DeviceMesh,
) -> None:
    model = build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)
    model.vision.requires_grad_(False)
    parallelizer = tower_parallelizer()
    plan = parallelizer.plan(model, mp_policy=MP)
    assert plan.replicated_param_names  # the frozen fp32 norms
    assert any("replicated parameters" in note and "stay on the" in note for note in plan.notes)
    assert all(name.startswith("vision.") for name in plan.replicated_param_names)
    offloaded = [unit.label for unit in plan.units if unit.offload_policy is not None]
    assert offloaded
    assert all(label.startswith("vision") for label in offloaded)
    parallelizer.apply_plan(model, plan, mesh=mesh2)
    names = {id(m): n for n, m in model.named_modules()}
    for unit in internals.distinct_units(model):
        (group,) = internals.param_groups(unit)
        tower = names[id(unit)].startswith("vision")
        assert isinstance(group.offload_policy, CPUOffloadPolicy) == tower, names[id(unit)]
