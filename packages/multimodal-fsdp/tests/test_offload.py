"""CPU offload per part (``MultimodalParallelizer(offload=...)``): the option, the plan,
the units after applying it, and the memory estimate.

Plans need no process group; applying runs under the single-process ``fake`` backend,
where every tensor is on the CPU anyway, so placement is read from the offload policy
FSDP2 attached to each unit's parameter group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from _mm_toy_vlm import PATCH, TEXT_DEPTH, TOWER_DEPTH, VOCAB, ToyVLM
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

from fsdp_core import build_mesh, internals, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from fsdp_core.plan import ShardingPlan, unit_parameters
from multimodal_fsdp import MultimodalParallelizer, plan_costs
from multimodal_fsdp.estimate.memory import estimate_memory
from multimodal_fsdp.estimate.units import padded_shard_numel
from multimodal_fsdp.offload import OFFLOAD_PARTS, PartOffload

pytestmark = pytest.mark.filterwarnings(
    "ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning"
)

CPU = CPUOffloadPolicy(pin_memory=False)
TOWER_BLOCKS = [f"vision_tower.blocks.{i}" for i in range(TOWER_DEPTH)]
TEXT_LAYERS = [f"language_model.layers.{i}" for i in range(TEXT_DEPTH)]


@pytest.fixture
def mesh2() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


def offloaded_units(plan: ShardingPlan) -> list[str]:
    return [unit.label for unit in plan.units if unit.offload_policy is not None]


# --- the option ----------------------------------------------------------------------------


def test_the_parts_are_the_tower_the_projector_and_the_language_model() -> None:
    assert OFFLOAD_PARTS == ("tower", "projector", "language_model")


def test_no_offload_is_the_default() -> None:
    assert MultimodalParallelizer().offload == PartOffload()
    assert not PartOffload().any


def test_a_plain_policy_offloads_every_part() -> None:
    offload = MultimodalParallelizer(offload=CPU).offload
    assert offload == PartOffload(tower=CPU, projector=CPU, language_model=CPU)


def test_a_mapping_names_parts() -> None:
    offload = MultimodalParallelizer(offload={"tower": CPU}).offload
    assert offload == PartOffload(tower=CPU)
    assert offload.for_part("tower") is CPU
    assert offload.for_part("language_model") is None


def test_an_unknown_part_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown offload part 'vision'; valid parts: tower, projector, language_model",
    ):
        MultimodalParallelizer(offload={"vision": CPU})


@pytest.mark.parametrize("value", ["cpu", True, 3])
def test_a_wrong_type_is_refused(value: object) -> None:
    with pytest.raises(TypeError, match=r"offload must be an OffloadPolicy, a mapping"):
        MultimodalParallelizer(offload=value)  # type: ignore[arg-type]


def test_a_wrong_policy_type_in_the_mapping_is_refused() -> None:
    with pytest.raises(TypeError, match=r"offload\['tower'\] must be an OffloadPolicy or None"):
        MultimodalParallelizer(offload={"tower": "cpu"})  # type: ignore[dict-item]


def test_with_options_keeps_the_offload() -> None:
    parallelizer = MultimodalParallelizer(offload={"tower": CPU})
    clone = parallelizer.with_options(frozen_multimodal_sharding="per_layer")
    assert clone.offload == PartOffload(tower=CPU)


# --- the plan ------------------------------------------------------------------------------


def test_offloading_the_tower_offloads_its_blocks_and_a_unit_for_the_rest() -> None:
    model = ToyVLM(frozen_tower=True)
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer", offload={"tower": CPU}
    ).plan(model)
    assert offloaded_units(plan) == [*TOWER_BLOCKS, "vision_tower"]
    # Every tower parameter sits in an offloaded unit; nothing else does.
    for unit, params in zip(plan.units, unit_parameters(plan, model), strict=True):
        tower = {name.startswith("vision_tower.") for name, _ in params}
        assert tower <= {unit.offload_policy is not None}, unit.label
    assert "offload=cpu" in plan.format()
    assert any("offload" in note and "tower" in note for note in plan.notes)


def test_without_offload_the_plan_is_unchanged() -> None:
    model = ToyVLM(frozen_tower=True)
    plain = MultimodalParallelizer(frozen_multimodal_sharding="per_layer").plan(model)
    assert offloaded_units(plain) == []
    assert "vision_tower" not in plain.unit_labels()
    assert "offload" not in plain.format()


def test_offloading_the_language_model_offloads_the_root() -> None:
    model = ToyVLM(frozen_tower=True)
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer", offload={"language_model": CPU}
    ).plan(model)
    # The tower keeps its own units on the device (a unit for the rest of it too); the
    # projector (trainable, in the root) would go with the root: it gets its own unit.
    assert offloaded_units(plan) == [*TEXT_LAYERS, "<root>"]
    assert "vision_tower" in plan.unit_labels()
    assert "multi_modal_projector" in plan.unit_labels()


def test_a_plain_policy_offloads_every_unit_without_new_units() -> None:
    model = ToyVLM(frozen_tower=True)
    plain = MultimodalParallelizer(frozen_multimodal_sharding="per_layer").plan(model)
    every = MultimodalParallelizer(frozen_multimodal_sharding="per_layer", offload=CPU).plan(model)
    assert every.unit_labels() == plain.unit_labels()
    assert offloaded_units(every) == every.unit_labels()


def test_root_policy_cannot_offload_the_tower_alone() -> None:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding="root", offload={"tower": CPU})
    with pytest.raises(ValueError, match=r"'vision_tower'.*root unit.*per_layer"):
        parallelizer.plan(model)


def test_replicate_policy_cannot_offload_the_tower() -> None:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(
        frozen_multimodal_sharding="replicate", offload={"tower": CPU}
    )
    with pytest.raises(ValueError, match=r"'vision_tower'.*replicate.*per_layer"):
        parallelizer.plan(model)


def test_replicate_policy_keeps_the_tower_on_the_device_when_the_rest_is_offloaded() -> None:
    model = ToyVLM(frozen_tower=True)
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding="replicate", offload={"language_model": CPU, "projector": CPU}
    ).plan(model)
    assert "<root>" in offloaded_units(plan)
    assert plan.replicated_param_names  # the tower, whole on every device


def test_a_trainable_tower_can_be_offloaded() -> None:
    model = ToyVLM()
    plan = MultimodalParallelizer(offload={"tower": CPU}).plan(model)
    assert offloaded_units(plan) == [*TOWER_BLOCKS, "vision_tower"]


def test_a_partly_trainable_tower_under_per_layer() -> None:
    model = ToyVLM(frozen_tower=True)
    model.vision_tower.blocks[0].requires_grad_(True)
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer", offload={"tower": CPU}
    ).plan(model)
    assert offloaded_units(plan) == [*TOWER_BLOCKS, "vision_tower"]


def test_the_plan_digest_sees_the_offload() -> None:
    from fsdp_core.parallelizer import _plan_digest

    model = ToyVLM(frozen_tower=True)
    plain = MultimodalParallelizer(frozen_multimodal_sharding="per_layer").plan(model)
    every = MultimodalParallelizer(frozen_multimodal_sharding="per_layer", offload=CPU).plan(model)
    assert _plan_digest(plain) != _plan_digest(every)


# --- applied -------------------------------------------------------------------------------


def unit_offload(model: nn.Module) -> dict[str, OffloadPolicy]:
    names = {id(m): n for n, m in model.named_modules()}
    result = {}
    for unit in internals.distinct_units(model):
        (group,) = internals.param_groups(unit)
        result[names[id(unit)] or "<root>"] = group.offload_policy
    return result


def test_applied_units_carry_their_offload(mesh2: DeviceMesh) -> None:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer",
        offload={"tower": CPUOffloadPolicy(pin_memory=True)},
    )
    parallelizer.parallelize(model, mesh=mesh2, mp_policy=mixed_precision_policy("bf16", "fp32"))
    placed = unit_offload(model)
    for label, policy in placed.items():
        if label.startswith("vision_tower"):
            assert isinstance(policy, CPUOffloadPolicy), label
            if not torch.accelerator.is_available():
                assert policy.pin_memory is False, label  # the CPU fallback
        else:
            assert not isinstance(policy, CPUOffloadPolicy), label
    assert sorted(label for label in placed if label.startswith("vision_tower")) == sorted(
        [*TOWER_BLOCKS, "vision_tower"]
    )
    # Offloaded sharded parameters live on the CPU and the model still trains.
    for param in model.vision_tower.parameters():
        assert param.device.type == "cpu"
    logits = model(torch.randn(2, 3, PATCH), torch.randint(0, VOCAB, (2, 5)))
    logits.float().pow(2).mean().backward()
    assert isinstance(model, FSDPModule)


def test_apply_refuses_a_second_offload_beside_the_plans(mesh2: DeviceMesh) -> None:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer", offload={"tower": CPU}
    )
    plan = parallelizer.plan(model)
    with pytest.raises(ValueError, match=r"plan already offloads.*offload_policy="):
        parallelizer.apply_plan(model, plan, mesh=mesh2, offload_policy=CPU)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


# --- the memory estimate -------------------------------------------------------------------


def tower_shard_bytes(model: nn.Module, shard: int) -> int:
    return sum(
        padded_shard_numel(p, shard) * p.dtype.itemsize
        for name, p in model.named_parameters()
        if name.startswith("vision_tower.")
    )


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
def test_the_estimate_moves_the_towers_shards_to_the_host(frozen: bool) -> None:
    model = ToyVLM(frozen_tower=frozen)
    # The same units with and without offload (the tower's own unit in both): compare
    # like with like.
    plan_off = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer", offload={"tower": CPU}
    ).plan(model)
    plan_on = dataclasses.replace(
        plan_off,
        calls=tuple(
            dataclasses.replace(
                call,
                offload_policy=None,
                units=tuple(dataclasses.replace(u, offload_policy=None) for u in call.units),
            )
            for call in plan_off.calls
        ),
    )
    shard = 4
    on = estimate_memory(plan_costs(plan_on, model, world_size=shard), plan_on, model)
    off = estimate_memory(plan_costs(plan_off, model, world_size=shard), plan_off, model)
    tower = tower_shard_bytes(model, shard)
    assert tower > 0
    assert on.sharded_param_bytes - off.sharded_param_bytes == tower
    assert off.host_param_bytes == tower
    assert on.host_param_bytes == 0
    if frozen:
        assert off.gradient_bytes == on.gradient_bytes
        assert off.host_gradient_bytes == off.host_optimizer_bytes == 0
    else:
        # Gradients and Adam state (two tensors of the shard, plus a 4-byte step each).
        count = sum(1 for n, _ in model.named_parameters() if n.startswith("vision_tower."))
        assert on.gradient_bytes - off.gradient_bytes == tower == off.host_gradient_bytes
        assert on.optimizer_bytes - off.optimizer_bytes == 2 * tower + 4 * count
        assert off.host_optimizer_bytes == 2 * tower + 4 * count
    assert off.resting_bytes == on.resting_bytes - tower - off.host_optimizer_bytes
    assert off.host_bytes == tower + off.host_gradient_bytes + off.host_optimizer_bytes
    assert "host (offloaded)" in "\n".join(off.format_lines())
    assert off.as_dict()["host_param_bytes"] == tower


# --- more edge cases -------------------------------------------------------------------------


def test_every_part_can_be_offloaded_under_root() -> None:
    model = ToyVLM(frozen_tower=True)
    plan = MultimodalParallelizer(frozen_multimodal_sharding="root", offload=CPU).plan(model)
    assert offloaded_units(plan) == plan.unit_labels()
    assert "vision_tower" not in plan.unit_labels()  # root: the tower stays in the root unit


def test_uneven_media_folds_the_tower_into_the_root_so_it_cannot_be_offloaded_alone() -> None:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(uneven_media=True, offload={"tower": CPU})
    with pytest.raises(ValueError, match=r"'vision_tower'.*uneven_media=True.*per_layer"):
        parallelizer.plan(model)


def test_a_partly_trainable_tower_under_root_cannot_be_offloaded_alone() -> None:
    model = ToyVLM(frozen_tower=True)
    model.vision_tower.blocks[0].requires_grad_(True)
    parallelizer = MultimodalParallelizer(offload={"tower": CPU})
    with pytest.raises(ValueError, match=r"'vision_tower'.*root unit.*per_layer"):
        parallelizer.plan(model)


def test_a_balanced_tower_can_be_offloaded() -> None:
    model = ToyVLM(frozen_tower=True)
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer", balance_media=True, offload={"tower": CPU}
    ).plan(model)
    assert offloaded_units(plan) == [*TOWER_BLOCKS, "vision_tower"]


# --- the measured side -------------------------------------------------------------------------


def test_a_measured_step_reads_the_accelerator_beside_offloaded_host_memory() -> None:
    """With units offloaded the tracker reports the CPU beside the GPU, in no fixed order:
    the device figures are the accelerator's, the host ones the CPU's."""
    from multimodal_fsdp.measure.memory import _cpu_or_first, _host_of

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    snapshot = {cpu: {"Sharded Param": 3}, gpu: {"Sharded Param": 5}}
    assert _cpu_or_first(snapshot) == {"Sharded Param": 5}
    assert _host_of(snapshot) == {"Sharded Param": 3}
    assert _cpu_or_first({cpu: {"Sharded Param": 3}}) == {"Sharded Param": 3}
    assert _host_of({cpu: {"Sharded Param": 3}}) is None
