"""Unit tests for multimodal_fsdp.parallelizer: plans per frozen-tower policy, then apply.

Plans are checked without a process group; applying runs under the single-process
``fake`` backend (real layouts and collectives, meaningless numbers), with a
forward and backward step per policy and exact collective accounting.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _mm_toy_vlm import DIM, PATCH, TEXT_DEPTH, TOWER_DEPTH, VOCAB, ToyVLM
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_core import (
    CommCounter,
    ModelParallelizer,
    ShardingPlan,
    build_mesh,
    mixed_precision_policy,
)
from fsdp_core.fake_group import fake_process_group
from fsdp_core.runtime import installed_hooks
from multimodal_fsdp import VALID_FROZEN_MULTIMODAL_SHARDING, MultimodalParallelizer
from multimodal_fsdp.parts import MultimodalParts, split_frozen_parts
from multimodal_fsdp.policy import FrozenPolicies
from multimodal_fsdp.record import plan_record

POLICIES = VALID_FROZEN_MULTIMODAL_SHARDING

TEXT_UNITS = [f"language_model.layers.{i}" for i in range(TEXT_DEPTH)]
TOWER_BLOCKS = [f"vision_tower.blocks.{i}" for i in range(TOWER_DEPTH)]
QWEN_BLOCKS = [f"visual.blocks.{i}" for i in range(TOWER_DEPTH)]

# The toy models return lm_head's output directly; FSDP warns that it is a view.
pytestmark = pytest.mark.filterwarnings(
    "ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning"
)


# --- models ------------------------------------------------------------------------------


class VlmWithoutMediaArgument(ToyVLM):
    """The same VLM, but its forward names no media argument the guard knows."""

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(pixels, input_ids)


def frozen_vlm() -> ToyVLM:
    return ToyVLM(frozen_tower=True)


def merger_trainable_vlm() -> ToyVLM:
    model = ToyVLM(qwen=True, frozen_tower=True)
    model.visual.merger.requires_grad_(True)
    return model


def unit_paths(plan: ShardingPlan) -> list[str]:
    return [path for unit in plan.units for path in unit.paths]


def param_names(model: nn.Module, prefix: str) -> list[str]:
    return sorted(name for name, _ in model.named_parameters() if name.startswith(prefix + "."))


def owned_param_names(model: nn.Module, paths: tuple[str, ...]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        module = model.get_submodule(path) if path else model
        names.update(name for name, _ in module.named_parameters(prefix=path))
    return names


def step(model: nn.Module) -> torch.Tensor:
    """One forward and backward with fp32 inputs; returns the logits."""
    pixels = torch.randn(2, 3, PATCH)
    input_ids = torch.randint(0, VOCAB, (2, 5))
    logits = model(pixels, input_ids)
    logits.float().pow(2).mean().backward()
    return logits


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture
def mesh2() -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh of size 2 over the fake process group (destroyed afterwards)."""
    with fake_process_group(2):
        yield build_mesh()


# --- constructor and with_options ----------------------------------------------------------


def test_is_a_model_parallelizer_with_root_as_default() -> None:
    parallelizer = MultimodalParallelizer()
    assert isinstance(parallelizer, ModelParallelizer)
    assert parallelizer.frozen_policies == FrozenPolicies("root")
    assert parallelizer.sync_replicated is True
    assert parallelizer.dtype_safe is True


@pytest.mark.parametrize(
    ("value", "expected"),
    [("Per-Layer", "per_layer"), (" REPLICATE ", "replicate"), ("root", "root")],
)
def test_constructor_normalizes_the_policy(value: str, expected: str) -> None:
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=value)
    assert parallelizer.frozen_policies == FrozenPolicies(expected)  # type: ignore[arg-type]


def test_constructor_rejects_an_unknown_policy() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown frozen multimodal sharding 'shard'; valid choices: root, per_layer, "
        r"replicate",
    ):
        MultimodalParallelizer(frozen_multimodal_sharding="shard")


def test_constructor_rejects_a_non_string_policy() -> None:
    with pytest.raises(TypeError, match=r"must be a str, got NoneType.*valid choices: root"):
        MultimodalParallelizer(frozen_multimodal_sharding=None)  # type: ignore[arg-type]


def test_constructor_rejects_a_non_bool_sync_replicated() -> None:
    with pytest.raises(TypeError, match="sync_replicated must be a bool, got 1"):
        MultimodalParallelizer(sync_replicated=1)  # type: ignore[arg-type]


def test_constructor_rejects_a_non_bool_dtype_safe() -> None:
    with pytest.raises(TypeError, match="dtype_safe must be a bool, got 'yes'"):
        MultimodalParallelizer(dtype_safe="yes")  # type: ignore[arg-type]


def test_constructor_options_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional argument"):
        MultimodalParallelizer("replicate")  # type: ignore[misc]


@pytest.mark.parametrize("argument", ["extra_tower_names", "extra_projector_names", "exclude"])
def test_name_options_reject_a_bare_string(argument: str) -> None:
    with pytest.raises(TypeError, match=f"{argument} must be a collection of str"):
        MultimodalParallelizer(**{argument: "vision_tower"}).plan(ToyVLM())


def test_with_options_returns_a_copy_with_the_new_policy() -> None:
    original = MultimodalParallelizer(
        frozen_multimodal_sharding="root",
        extra_tower_names=("my_encoder",),
        sync_replicated=False,
        dtype_safe=False,
    )
    clone = original.with_options(frozen_multimodal_sharding="Per-Layer")
    assert clone is not original
    assert type(clone) is MultimodalParallelizer
    assert clone.frozen_policies.label == "per_layer"
    assert original.frozen_policies.label == "root"
    assert clone.extra_tower_names == ("my_encoder",)
    assert clone.sync_replicated is False
    assert clone.dtype_safe is False


def test_with_options_plans_differ_only_through_the_policy() -> None:
    root = MultimodalParallelizer()
    replicate = root.with_options(frozen_multimodal_sharding="replicate")
    model = frozen_vlm()
    assert root.plan(model).replicated_param_names == ()
    assert replicate.plan(model).replicated_param_names == tuple(param_names(model, "vision_tower"))


def test_with_options_rejects_bad_values() -> None:
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding="replicate")
    with pytest.raises(ValueError, match=r"unknown frozen multimodal sharding 'layerwise'"):
        parallelizer.with_options(frozen_multimodal_sharding="layerwise")
    with pytest.raises(TypeError, match=r"must be a str, got int \(2\)"):
        parallelizer.with_options(frozen_multimodal_sharding=2)  # type: ignore[arg-type]
    assert parallelizer.frozen_policies.label == "replicate"


# --- split_frozen_parts and multimodal_parts -----------------------------------------------


def test_split_frozen_parts_of_a_fully_frozen_module() -> None:
    model = frozen_vlm()
    assert split_frozen_parts(model.vision_tower, "vision_tower") == (["vision_tower"], [])


def test_split_frozen_parts_of_a_trainable_module() -> None:
    model = ToyVLM()
    assert split_frozen_parts(model.vision_tower, "vision_tower") == ([], ["vision_tower"])


def test_split_frozen_parts_of_a_parameterless_module() -> None:
    assert split_frozen_parts(nn.GELU(), "act") == ([], [])


def test_split_frozen_parts_of_a_tower_with_a_trainable_merger() -> None:
    model = merger_trainable_vlm()
    assert split_frozen_parts(model.visual, "visual") == (
        ["visual.patch_embed", "visual.blocks"],
        ["visual.merger"],
    )


def test_split_frozen_parts_recurses_into_mixed_children() -> None:
    model = ToyVLM()
    model.vision_tower.requires_grad_(False)
    model.vision_tower.blocks[1].fc.requires_grad_(True)
    frozen, trainable = split_frozen_parts(model.vision_tower, "vision_tower")
    assert frozen == [
        "vision_tower.patch_embed",
        "vision_tower.blocks.0",
        "vision_tower.blocks.1.norm",
        "vision_tower.blocks.2",
        "vision_tower.post_norm",
    ]
    assert trainable == ["vision_tower.blocks.1.fc"]


def test_split_frozen_parts_leaves_direct_parameters_of_mixed_modules_out() -> None:
    tower = nn.Module()
    tower.pos_embed = nn.Parameter(torch.zeros(DIM), requires_grad=False)
    tower.proj = nn.Linear(DIM, DIM)
    assert split_frozen_parts(tower, "t") == ([], ["t.proj"])


def test_multimodal_parts_reports_each_found_module() -> None:
    parts = MultimodalParallelizer().multimodal_parts(frozen_vlm())
    assert [type(p) for p in parts] == [MultimodalParts, MultimodalParts]
    tower, projector = parts
    assert (tower.found.path, tower.found.role) == ("vision_tower", "tower")
    assert (tower.frozen, tower.trainable) == (["vision_tower"], [])
    assert (projector.found.path, projector.found.role) == ("multi_modal_projector", "projector")
    assert (projector.frozen, projector.trainable) == ([], ["multi_modal_projector"])
    assert repr(tower) == "MultimodalParts('vision_tower', frozen=['vision_tower'], trainable=[])"


# --- plan() without a process group: a frozen tower ----------------------------------------


def test_plan_root_gives_the_frozen_tower_no_unit() -> None:
    model = frozen_vlm()
    plan = MultimodalParallelizer(frozen_multimodal_sharding="root").plan(model)
    assert not dist.is_initialized()
    # The trainable projector has no layer container: it stays in the root unit.
    assert unit_paths(plan) == [*TEXT_UNITS, ""]
    assert plan.ignored_param_names == ()
    assert plan.replicated_param_names == ()
    assert all(call.ignored_param_names == () for call in plan.calls)
    assert plan.role_counts() == {"layer": TEXT_DEPTH, "root": 1}


def test_plan_per_layer_gives_one_unit_per_tower_block() -> None:
    model = frozen_vlm()
    plan = MultimodalParallelizer(frozen_multimodal_sharding="per_layer").plan(model)
    assert unit_paths(plan) == [*TEXT_UNITS, *TOWER_BLOCKS, ""]
    assert plan.ignored_param_names == ()
    assert plan.replicated_param_names == ()
    # patch_embed and post_norm (outside the block list) fall to the root unit.
    tower_units = [path for path in unit_paths(plan) if path.startswith("vision_tower")]
    assert tower_units == TOWER_BLOCKS


def test_plan_replicate_ignores_the_tower_in_every_call_that_owns_it() -> None:
    model = frozen_vlm()
    plan = MultimodalParallelizer(frozen_multimodal_sharding="replicate").plan(model)
    tower = tuple(param_names(model, "vision_tower"))
    assert unit_paths(plan) == [*TEXT_UNITS, ""]
    assert plan.replicated_param_names == tower
    assert plan.ignored_param_names == tower
    (root_call,) = [call for call in plan.calls if call.paths == ("",)]
    assert set(tower) <= set(root_call.ignored_param_names)
    for call in plan.calls:
        owned = owned_param_names(model, call.paths) & set(tower)
        assert owned <= set(call.ignored_param_names), call.paths
        for unit in call.units:
            assert owned <= set(unit.ignored_param_names)
    assert not any(path.startswith("vision_tower") for path in unit_paths(plan))


def test_plan_replicate_keeps_user_ignored_params_apart() -> None:
    model = frozen_vlm()
    plan = MultimodalParallelizer(frozen_multimodal_sharding="replicate").plan(
        model, ignored_params={model.lm_head.bias}
    )
    tower = param_names(model, "vision_tower")
    assert plan.replicated_param_names == tuple(tower)
    assert plan.ignored_param_names == tuple(sorted([*tower, "lm_head.bias"]))


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_does_not_touch_the_model(policy: str) -> None:
    model = frozen_vlm()
    before = {name: (p.dtype, p.device, type(p)) for name, p in model.named_parameters()}
    MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(
        model, mp_policy=mixed_precision_policy("bf16", "fp32")
    )
    after = {name: (p.dtype, p.device, type(p)) for name, p in model.named_parameters()}
    assert after == before


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_notes_name_the_policy_and_the_frozen_parts(policy: str) -> None:
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(frozen_vlm())
    assert plan.notes == (
        f"tower 'vision_tower' (vision): frozen, policy {policy!r}",
        "projector 'multi_modal_projector' (vision): trainable, sharded like any other module",
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_of_a_trainable_tower_is_the_same_under_every_policy(policy: str) -> None:
    model = ToyVLM()
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
    # The trainable tower's blocks are units; patch_embed, post_norm and the projector
    # (no layer container) stay in the root unit.
    assert unit_paths(plan) == [*TEXT_UNITS, *TOWER_BLOCKS, ""]
    assert plan.ignored_param_names == ()
    assert plan.replicated_param_names == ()


def test_frozen_projector_follows_the_policy_too() -> None:
    model = frozen_vlm()
    model.multi_modal_projector.requires_grad_(False)
    replicate = MultimodalParallelizer(frozen_multimodal_sharding="replicate").plan(model)
    assert unit_paths(replicate) == [*TEXT_UNITS, ""]
    assert set(replicate.replicated_param_names) == set(
        param_names(model, "vision_tower") + param_names(model, "multi_modal_projector")
    )
    per_layer = MultimodalParallelizer(frozen_multimodal_sharding="per_layer").plan(model)
    # No layer container in the projector: it is one unit.
    assert unit_paths(per_layer) == [*TEXT_UNITS, *TOWER_BLOCKS, "multi_modal_projector", ""]
    root = MultimodalParallelizer(frozen_multimodal_sharding="root").plan(model)
    assert unit_paths(root) == [*TEXT_UNITS, ""]


def test_plan_per_layer_gives_a_block_shared_by_two_lists_one_unit() -> None:
    model = frozen_vlm()
    tower = model.vision_tower
    tower.extra_blocks = nn.ModuleList([tower.blocks[0]])
    plan = MultimodalParallelizer(frozen_multimodal_sharding="per_layer").plan(model)
    assert unit_paths(plan) == [*TEXT_UNITS, *TOWER_BLOCKS, ""]
    assert plan.role_counts() == {"layer": TEXT_DEPTH + TOWER_DEPTH, "root": 1}


def test_apply_per_layer_shards_a_block_shared_by_two_lists_once(mesh2: DeviceMesh) -> None:
    model = frozen_vlm()
    tower = model.vision_tower
    tower.extra_blocks = nn.ModuleList([tower.blocks[0]])
    apply("per_layer", model, mesh2)
    assert tower.extra_blocks[0] is tower.blocks[0]
    assert all(isinstance(block, FSDPModule) for block in tower.blocks)
    # Wrapped once: one FSDP class in the MRO below FSDPModule itself.
    mro = type(tower.blocks[0]).__mro__
    wrappers = [c for c in mro if issubclass(c, FSDPModule) and c is not FSDPModule]
    assert len(wrappers) == 1, wrappers
    states = {id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)}
    assert len(states) == TEXT_DEPTH + TOWER_DEPTH + 1
    step(model)


# --- plan(): a tower frozen except its merger (Qwen-VL) ------------------------------------


@pytest.mark.parametrize(
    ("policy", "tower_units"),
    [
        ("root", []),
        # The same units as the fully frozen tower: one per block, and the frozen
        # patch embedding (outside any layer) in the root unit with the merger.
        ("per_layer", QWEN_BLOCKS),
        ("replicate", []),
    ],
)
def test_plan_of_a_tower_with_a_trainable_merger(policy: str, tower_units: list[str]) -> None:
    model = merger_trainable_vlm()
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
    assert unit_paths(plan) == [*TEXT_UNITS, *tower_units, ""]
    frozen = tuple(param_names(model, "visual.patch_embed") + param_names(model, "visual.blocks"))
    expected_replicated = tuple(sorted(frozen)) if policy == "replicate" else ()
    assert plan.replicated_param_names == expected_replicated
    # The trainable merger is no unit of its own, nor ignored: the root unit owns it.
    assert not any(name.startswith("visual.merger") for name in plan.ignored_param_names)
    (note,) = plan.notes
    assert note.startswith(
        "tower 'visual' (vision): partly trainable (layers: 3 frozen; trainable parts: "
        f"'merger'); {policy!r}: "
    )


# --- apply under the fake process group ----------------------------------------------------


def bf16_tower_with_fp32_norm() -> ToyVLM:
    """A frozen tower stored in bf16 except its fp32 ``post_norm``; the rest fp32."""
    model = frozen_vlm()
    model.vision_tower.to(torch.bfloat16)
    model.vision_tower.post_norm.float()
    return model


def apply(policy: str, model: nn.Module, mesh: DeviceMesh, **options: bool) -> nn.Module:
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy, **options)
    return parallelizer.parallelize(
        model, mesh=mesh, mp_policy=mixed_precision_policy("bf16", "fp32")
    )


def check_trained(model: nn.Module, frozen_prefix: str) -> None:
    for name, param in model.named_parameters():
        if name.startswith(frozen_prefix + "."):
            assert param.grad is None, name
        else:
            assert param.grad is not None, name


def test_apply_replicate_keeps_the_tower_whole_in_compute_dtype(mesh2: DeviceMesh) -> None:
    model = apply("replicate", bf16_tower_with_fp32_norm(), mesh2)
    for name, param in model.vision_tower.named_parameters():
        assert not isinstance(param, DTensor), name
        assert isinstance(param, nn.Parameter), name
        assert param.device.type == "cpu"
        expected = torch.float32 if name.startswith("post_norm.") else torch.bfloat16
        assert param.dtype == expected, name
    for name, param in model.named_parameters():
        if not name.startswith("vision_tower."):
            assert isinstance(param, DTensor), name
    assert not any(isinstance(m, FSDPModule) for m in model.vision_tower.modules())
    assert isinstance(model, FSDPModule)
    logits = step(model)
    assert logits.dtype == torch.bfloat16
    assert logits.shape == (2, 8, VOCAB)
    check_trained(model, "vision_tower")


def test_apply_replicate_keeps_islands_of_a_partly_trainable_tower(mesh2: DeviceMesh) -> None:
    model = bf16_tower_with_fp32_norm()
    model.vision_tower.blocks[0].fc.requires_grad_(True)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding="replicate")
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    assert "vision_tower.post_norm.weight" in plan.replicated_param_names
    parallelizer.apply_plan(model, plan, mesh=mesh2)
    assert model.vision_tower.post_norm.weight.dtype == torch.float32
    assert model.vision_tower.patch_embed.weight.dtype == torch.bfloat16


def test_apply_replicate_casts_an_fp32_tower_to_the_compute_dtype(mesh2: DeviceMesh) -> None:
    model = apply("replicate", frozen_vlm(), mesh2)
    assert {p.dtype for p in model.vision_tower.parameters()} == {torch.bfloat16}
    step(model)


def test_apply_replicate_without_mixed_precision_keeps_dtypes(mesh2: DeviceMesh) -> None:
    model = bf16_tower_with_fp32_norm()
    MultimodalParallelizer(frozen_multimodal_sharding="replicate").parallelize(model, mesh=mesh2)
    dtypes = {name: p.dtype for name, p in model.vision_tower.named_parameters()}
    assert dtypes["post_norm.weight"] == torch.float32
    assert dtypes["patch_embed.weight"] == torch.bfloat16


def test_apply_per_layer_makes_each_tower_block_an_fsdp_module(mesh2: DeviceMesh) -> None:
    model = apply("per_layer", bf16_tower_with_fp32_norm(), mesh2)
    for block in model.vision_tower.blocks:
        assert isinstance(block, FSDPModule)
    assert not isinstance(model.vision_tower, FSDPModule)
    assert not isinstance(model.vision_tower.patch_embed, FSDPModule)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    step(model)
    check_trained(model, "vision_tower")


def test_apply_root_leaves_tower_blocks_inside_the_root_unit(mesh2: DeviceMesh) -> None:
    model = apply("root", bf16_tower_with_fp32_norm(), mesh2)
    assert not any(isinstance(m, FSDPModule) for m in model.vision_tower.modules())
    assert isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) for p in model.vision_tower.parameters())
    step(model)
    check_trained(model, "vision_tower")


@pytest.mark.parametrize("policy", POLICIES)
def test_apply_a_tower_with_a_trainable_merger(policy: str) -> None:
    with fake_process_group(4):
        mesh = build_mesh()
        model = merger_trainable_vlm()
        apply(policy, model, mesh)
        # The trainable merger is sharded inside the root unit.
        assert not isinstance(model.visual.merger, FSDPModule)
        assert all(isinstance(p, DTensor) for p in model.visual.merger.parameters())
        assert all(isinstance(b, FSDPModule) for b in model.visual.blocks) == (
            policy == "per_layer"
        )
        assert not isinstance(model.visual.patch_embed, FSDPModule)
        frozen = [*model.visual.patch_embed.parameters(), *model.visual.blocks.parameters()]
        assert all(isinstance(p, DTensor) for p in frozen) == (policy != "replicate")
        step(model)
        for name, param in model.named_parameters():
            trainable = not name.startswith("visual.") or name.startswith("visual.merger.")
            assert (param.grad is not None) == trainable, name


@pytest.mark.parametrize("sync", [True, False])
def test_apply_replicate_broadcasts_each_replicated_parameter_once(
    mesh2: DeviceMesh, sync: bool
) -> None:
    model = frozen_vlm()
    replicated = len(param_names(model, "vision_tower"))
    with CommCounter() as counter:
        apply("replicate", model, mesh2, sync_replicated=sync)
    assert counter.counts().get("broadcast", 0) == (replicated if sync else 0)
    assert counter.counts().get("all_gather", 0) == 0
    tower_bf16_bytes = 2 * sum(p.numel() for p in model.vision_tower.parameters())
    assert counter.bytes().get("broadcast", 0) == (tower_bf16_bytes if sync else 0)


def test_apply_replicate_on_the_meta_device(mesh2: DeviceMesh) -> None:
    with torch.device("meta"):
        model = ToyVLM()
    model.vision_tower.requires_grad_(False)
    apply("replicate", model, mesh2)
    for param in model.vision_tower.parameters():
        assert not isinstance(param, DTensor)
        assert param.device.type == "meta"
        assert param.dtype == torch.bfloat16


@pytest.mark.parametrize("policy", ["root", "per_layer"])
def test_apply_on_the_meta_device(mesh2: DeviceMesh, policy: str) -> None:
    with torch.device("meta"):
        model = ToyVLM()
    model.vision_tower.requires_grad_(False)
    apply(policy, model, mesh2)
    assert all(isinstance(p, DTensor) and p.device.type == "meta" for p in model.parameters())


def test_apply_replicate_judges_fp32_islands_per_multimodal_module(mesh2: DeviceMesh) -> None:
    """A frozen fp32 projector is cast (fp32 is its own dtype), the fp32 norm of a bf16
    tower is not (an island in its tower), though bf16 dominates the replicated set."""
    model = bf16_tower_with_fp32_norm()
    model.multi_modal_projector.requires_grad_(False)
    replicated = [*model.vision_tower.parameters(), *model.multi_modal_projector.parameters()]
    bf16 = sum(p.numel() for p in replicated if p.dtype == torch.bfloat16)
    assert bf16 > sum(p.numel() for p in replicated if p.dtype == torch.float32)
    assert {p.dtype for p in model.multi_modal_projector.parameters()} == {torch.float32}
    apply("replicate", model, mesh2)
    assert {p.dtype for p in model.multi_modal_projector.parameters()} == {torch.bfloat16}
    for name, param in model.vision_tower.named_parameters():
        expected = torch.float32 if name.startswith("post_norm.") else torch.bfloat16
        assert param.dtype == expected, name
    assert not any(isinstance(p, DTensor) for p in replicated)
    step(model)


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """One module per distinct FSDP state."""
    units: dict[int, FSDPModule] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(module._get_fsdp_state()), module)
    return list(units.values())


@pytest.mark.parametrize("policy", POLICIES)
def test_apply_makes_every_unit_reduce_scatter_unused_params(
    mesh2: DeviceMesh, policy: str
) -> None:
    model = apply(policy, merger_trainable_vlm(), mesh2)
    units = fsdp_units(model)
    assert len(units) == (TEXT_DEPTH + 1 + TOWER_DEPTH if policy == "per_layer" else 3)
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        assert group is not None
        assert group.reduce_scatter_unused_params is True


def test_apply_accumulates_over_a_micro_batch_that_skips_the_projector(mesh2: DeviceMesh) -> None:
    """Gradient accumulation: a text-only micro-batch (no image, so the projector in the
    root unit gets no gradient) before an image one; both steps complete."""
    model = apply("root", frozen_vlm(), mesh2)
    input_ids = torch.randint(0, VOCAB, (2, 5))
    model.set_requires_gradient_sync(False)
    model(None, input_ids).float().pow(2).mean().backward()
    assert model.multi_modal_projector[0].weight.grad is None
    model.set_requires_gradient_sync(True)
    step(model)
    check_trained(model, "vision_tower")
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert param.grad.dtype == param.dtype == torch.float32, name


#: (model, policy) -> the multimodal modules owning units, which the media guard names.
GUARDED: list[tuple[str, str, list[str]]] = [
    ("frozen", "root", []),
    ("frozen", "per_layer", ["vision_tower"]),
    ("frozen", "replicate", []),
    ("trainable", "root", ["vision_tower"]),
    ("trainable", "per_layer", ["vision_tower"]),
    ("trainable", "replicate", ["vision_tower"]),
    ("merger", "root", []),
    ("merger", "per_layer", ["visual"]),
    ("merger", "replicate", []),
]
MODELS = {"frozen": frozen_vlm, "trainable": ToyVLM, "merger": merger_trainable_vlm}


@pytest.mark.parametrize(("kind", "policy", "owners"), GUARDED)
def test_schedule_check_only_where_multimodal_modules_own_units(
    mesh2: DeviceMesh, kind: str, policy: str, owners: list[str]
) -> None:
    model = MODELS[kind]()
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy)
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    assert parallelizer.modules_with_units(model, plan) == owners
    assert ("schedule_check" in plan.hook_names()) == bool(owners)
    parallelizer.apply_plan(model, plan, mesh=mesh2)
    check = installed_hooks(model).get("schedule_check")
    checks = []
    counter = CommCounter()
    with counter:
        for _ in range(2):
            with counter.phase("forward"):
                logits = model(torch.randn(2, 3, PATCH), torch.randint(0, VOCAB, (2, 5)))
            checks.append(getattr(check, "last_checkpoints", 0))
            with counter.phase("backward"):
                logits.float().pow(2).mean().backward()
    # Two checkpoints per forward where checked (the tower's entry and the first unit
    # after it; under the fake group a rank meets only itself, so the ranks "agree"),
    # none otherwise; they meet at the c10d store, so no all-reduce in forward; one
    # usage-flag all-reduce per backward everywhere.
    assert checks == ([2, 2] if owners else [0, 0])
    assert [r for r in counter.records if r.kind == "all_reduce" and r.phase == "forward"] == []
    flags = [r.phase for r in counter.records if r.kind == "all_reduce" and r.dtype == torch.uint8]
    assert flags == ["backward"] * 2


def test_schedule_check_needs_no_media_argument_names(mesh2: DeviceMesh) -> None:
    """It watches where ranks are, not the forward's arguments: any signature works."""
    model = VlmWithoutMediaArgument()
    model.vision_tower.requires_grad_(False)
    apply("per_layer", model, mesh2)
    assert "schedule_check" in installed_hooks(model)
    step(model)
    assert installed_hooks(model)["schedule_check"].last_checkpoints == 2  # type: ignore[attr-defined]


# --- communication per policy --------------------------------------------------------------


def count_one_step(policy: str) -> CommCounter:
    """Collectives of one training step of the fp32 VLM (tower frozen) on 2 fake ranks."""
    with fake_process_group(2):
        model = apply(policy, frozen_vlm(), build_mesh())
        counter = CommCounter()
        with counter:
            with counter.phase("forward"):
                logits = model(torch.randn(2, 3, PATCH), torch.randint(0, VOCAB, (2, 5)))
            with counter.phase("backward"):
                logits.float().pow(2).mean().backward()
        return counter


@pytest.fixture(scope="module")
def step_counters() -> dict[str, CommCounter]:
    return {policy: count_one_step(policy) for policy in POLICIES}


def bf16_bytes(model: nn.Module, *, tower: bool) -> int:
    # Every dim 0 is even, so nothing is padded on 2 ranks: bytes are exact.
    return 2 * sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.startswith("vision_tower.") == tower
    )


def test_replicate_moves_no_tower_bytes(step_counters: dict[str, CommCounter]) -> None:
    model = frozen_vlm()
    tower, rest = bf16_bytes(model, tower=True), bf16_bytes(model, tower=False)
    replicate, root, per_layer = (step_counters[p] for p in ("replicate", "root", "per_layer"))
    # Forward gathers every sharded parameter once: all of them, or all but the tower.
    assert replicate.bytes("forward")["all_gather"] == rest
    assert root.bytes("forward")["all_gather"] == rest + tower
    assert per_layer.bytes("forward")["all_gather"] == rest + tower
    # Over the whole step, replicate moves exactly the tower less than root.
    assert root.bytes()["all_gather"] - replicate.bytes()["all_gather"] == tower
    assert replicate.bytes("backward")["all_gather"] == root.bytes("backward")["all_gather"]


def test_per_layer_runs_the_most_all_gathers(step_counters: dict[str, CommCounter]) -> None:
    counts = {policy: step_counters[policy].counts()["all_gather"] for policy in POLICIES}
    assert counts["root"] == counts["replicate"]
    assert counts["per_layer"] > counts["root"]
    forward = {p: step_counters[p].counts("forward")["all_gather"] for p in POLICIES}
    # One all-gather per frozen tower block in forward ...
    assert forward["per_layer"] - forward["root"] == TOWER_DEPTH
    # ... beside one per text layer and one for the root (which holds the projector).
    assert forward["root"] == forward["replicate"] == TEXT_DEPTH + 1
    # In backward only the text layers are re-gathered under every policy (the root keeps
    # its parameters after forward): no gradient reaches the frozen tower blocks, and the
    # backward-prefetch guard keeps FSDP's implicit prefetch from re-gathering the last one.
    backward = {p: step_counters[p].counts("backward")["all_gather"] for p in POLICIES}
    assert backward == dict.fromkeys(POLICIES, TEXT_DEPTH)
    # The same bytes as root in total: the tower is gathered once, block by block.
    per_layer_bytes = step_counters["per_layer"].bytes()["all_gather"]
    assert per_layer_bytes == step_counters["root"].bytes()["all_gather"]


def test_frozen_units_are_never_reduce_scattered(step_counters: dict[str, CommCounter]) -> None:
    # Trainable units: the text layers and the root (which holds the projector).
    trainable_units = TEXT_DEPTH + 1
    for policy, counter in step_counters.items():
        assert counter.counts()["reduce_scatter"] == trainable_units, policy
        assert counter.counts("forward").get("reduce_scatter", 0) == 0, policy
        assert {r.dtype for r in counter.records if r.kind == "reduce_scatter"} == {torch.float32}
    reduce_bytes = {counter.bytes()["reduce_scatter"] for counter in step_counters.values()}
    assert len(reduce_bytes) == 1


def test_a_step_runs_only_all_gathers_and_reduce_scatters_and_the_runtime_hooks(
    step_counters: dict[str, CommCounter],
) -> None:
    for policy, counter in step_counters.items():
        assert set(counter.counts()) == {"all_gather", "reduce_scatter", "all_reduce"}, policy
        hooks = [(r.phase, r.nbytes, r.dtype) for r in counter.records if r.kind == "all_reduce"]
        # unused_params: one flag per trainable parameter tensor, once per backward.
        trainable = sum(1 for p in frozen_vlm().parameters() if p.requires_grad)
        flags = ("backward", trainable, torch.uint8)
        # The forward agreement and the schedule checkpoints (per_layer: the tower owns
        # units) meet at the c10d store: no all-reduce in forward.
        assert hooks == [flags], policy
        assert {r.dtype for r in counter.records if r.kind == "all_gather"} == {torch.bfloat16}


# --- real transformers models built on the meta device -------------------------------------


def meta_model(class_name: str, config_name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)()
    with torch.device("meta"):
        model: nn.Module = getattr(transformers, class_name)._from_config(config)
    return model


@pytest.mark.transformers
@pytest.mark.parametrize("policy", POLICIES)
def test_llava_plans(policy: str) -> None:
    model = meta_model("LlavaForConditionalGeneration", "LlavaConfig")
    tower_path = "model.vision_tower"
    model.get_submodule(tower_path).requires_grad_(False)
    depth = model.config.vision_config.num_hidden_layers
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
    tower_units = [p for p in unit_paths(plan) if p.startswith(tower_path + ".")]
    tower_params = param_names(model, tower_path)
    if policy == "per_layer":
        assert tower_units == [f"{tower_path}.encoder.layers.{i}" for i in range(depth)]
        assert len(tower_units) == depth == 24
        assert {type(model.get_submodule(p)).__name__ for p in tower_units} == {"CLIPEncoderLayer"}
    else:
        assert tower_units == []
    assert plan.replicated_param_names == (tuple(tower_params) if policy == "replicate" else ())
    # The trainable projector (two Linears, no layer container) stays in the root unit.
    projector = "model.multi_modal_projector"
    assert not any(p == projector or p.startswith(projector + ".") for p in unit_paths(plan))
    assert not any(name.startswith(projector + ".") for name in plan.ignored_param_names)
    text_layers = model.config.text_config.num_hidden_layers
    assert sum(".language_model.layers." in p for p in unit_paths(plan)) == text_layers
    assert unit_paths(plan)[-1] == ""


@pytest.mark.transformers
@pytest.mark.parametrize("policy", POLICIES)
def test_qwen2_vl_plans(policy: str) -> None:
    model = meta_model("Qwen2VLForConditionalGeneration", "Qwen2VLConfig")
    tower_path = "model.visual"
    model.get_submodule(tower_path).requires_grad_(False)
    depth = model.config.vision_config.depth
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
    tower_units = [p for p in unit_paths(plan) if p.startswith(tower_path + ".")]
    if policy == "per_layer":
        assert tower_units == [f"{tower_path}.blocks.{i}" for i in range(depth)]
        assert len(tower_units) == depth == 32
    else:
        assert tower_units == []
    expected = tuple(param_names(model, tower_path)) if policy == "replicate" else ()
    assert plan.replicated_param_names == expected
    if policy == "replicate":
        (root_call,) = [call for call in plan.calls if call.paths == ("",)]
        assert set(expected) <= set(root_call.ignored_param_names)


@pytest.mark.transformers
@pytest.mark.parametrize(
    ("policy", "tower_units"),
    [
        ("root", []),
        ("per_layer", ["blocks"]),
        ("replicate", []),
    ],
)
def test_qwen2_vl_with_a_trainable_merger_plans(policy: str, tower_units: list[str]) -> None:
    model = meta_model("Qwen2VLForConditionalGeneration", "Qwen2VLConfig")
    visual = model.get_submodule("model.visual")
    visual.requires_grad_(False)
    visual.merger.requires_grad_(True)
    depth = model.config.vision_config.depth
    if "blocks" in tower_units:
        tower_units = [*tower_units[:-1], *(f"model.visual.blocks.{i}" for i in range(depth))]
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
    assert [p for p in unit_paths(plan) if p.startswith("model.visual.")] == tower_units
    frozen = sorted(
        name
        for name, p in model.named_parameters()
        if name.startswith("model.visual.") and not name.startswith("model.visual.merger.")
    )
    assert plan.replicated_param_names == (tuple(frozen) if policy == "replicate" else ())
    # The trainable merger is no unit of its own under any policy, nor ignored: the root
    # unit owns it.
    assert not any(name.startswith("model.visual.merger.") for name in plan.ignored_param_names)


# --- partly trainable towers: adapters (LoRA-style) and trainable blocks -------------------


class LoraLinear(nn.Module):
    """A frozen Linear with one trainable low-rank adapter, laid out as PEFT's LoRA layers."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(DIM, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, DIM, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def lora_vlm(*, tower: bool) -> ToyVLM:
    """Every base weight frozen; an adapter on each decoder layer's (and block's) ``fc``."""
    model = ToyVLM().requires_grad_(False)
    blocks = [*model.language_model.layers, *(model.vision_tower.blocks if tower else [])]
    for block in blocks:
        block.fc = LoraLinear(block.fc)
    return model


@pytest.mark.parametrize("tower", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_adapters_keep_the_units_of_the_frozen_model(policy: str, tower: bool) -> None:
    model = lora_vlm(tower=tower)
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
    frozen = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(
        ToyVLM().requires_grad_(False)
    )
    assert unit_paths(plan) == unit_paths(frozen)
    tower_units = [*TOWER_BLOCKS, "multi_modal_projector"] if policy == "per_layer" else []
    assert unit_paths(plan) == [*TEXT_UNITS, *tower_units, ""]
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not adapters & set(plan.ignored_param_names)
    if policy == "replicate":
        expected = {n for n, p in model.vision_tower.named_parameters(prefix="vision_tower")}
        assert set(plan.replicated_param_names) >= expected - adapters
    assert ("schedule_check" in plan.hook_names()) == (policy == "per_layer")


def _guarded(plan: ShardingPlan) -> list[str]:
    return [t for hook in plan.hooks if hook.name == "prefetch_guard" for t in hook.targets]


@pytest.mark.parametrize("policy", POLICIES)
def test_frozen_decoder_layers_behind_tower_adapters_are_not_guarded(policy: str) -> None:
    """Gradients reach a frozen decoder layer behind tower adapters on the ranks with
    images only; the guard decides per rank, so it would let only those ranks all-gather
    the layer in backward. Frozen units of towers and projectors stay guarded (under
    ``per_layer`` every rank must run them the same number of times)."""
    per_layer = policy == "per_layer"
    model = lora_vlm(tower=True)  # adapted tower blocks: units with trainable parameters
    model.language_model.layers[0].requires_grad_(False)
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
    assert _guarded(plan) == (["multi_modal_projector"] if per_layer else [])
    # Without trainable code that runs only with media the frozen layer stays guarded.
    model = lora_vlm(tower=False)
    model.language_model.layers[0].requires_grad_(False)
    plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
    tower = [*TOWER_BLOCKS, "multi_modal_projector"] if per_layer else []
    assert _guarded(plan) == ["language_model.layers.0", *tower]


def test_a_fully_trainable_block_in_a_frozen_tower_is_a_unit_under_every_policy() -> None:
    for policy in POLICIES:
        model = lora_vlm(tower=True)
        model.vision_tower.blocks[2].requires_grad_(True)
        plan = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
        tower_units = [p for p in unit_paths(plan) if p.startswith("vision_tower.")]
        expected = TOWER_BLOCKS if policy == "per_layer" else TOWER_BLOCKS[2:]
        assert tower_units == expected, policy
        assert "layers: 2 adapted, 1 trainable;" in plan.notes[0], plan.notes


@pytest.mark.parametrize("policy", POLICIES)
def test_apply_with_adapters_trains_only_the_adapters(policy: str, mesh2: DeviceMesh) -> None:
    model = apply(policy, lora_vlm(tower=True), mesh2)
    assert all(isinstance(b, FSDPModule) for b in model.vision_tower.blocks) == (
        policy == "per_layer"
    )
    step(model)
    for name, param in model.named_parameters():
        assert (param.grad is not None) == (".lora_" in name), name


# --- per-module policies -------------------------------------------------------------------

PROJECTOR = "multi_modal_projector"


def all_frozen_vlm() -> ToyVLM:
    """Tower and projector both frozen: two frozen parts, each with its own policy."""
    model = frozen_vlm()
    model.multi_modal_projector.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("policies", "units", "replicated"),
    [
        # The tower gathered block by block; the projector defaults to root.
        ({"vision_tower": "per_layer"}, [*TEXT_UNITS, *TOWER_BLOCKS, ""], []),
        (
            {"vision_tower": "per_layer", "*": "replicate"},
            [*TEXT_UNITS, *TOWER_BLOCKS, ""],
            [PROJECTOR],
        ),
        (
            {PROJECTOR: "per_layer", "*": "replicate"},
            [*TEXT_UNITS, PROJECTOR, ""],
            ["vision_tower"],
        ),
        ({"vision_tower": "replicate", PROJECTOR: "root"}, [*TEXT_UNITS, ""], ["vision_tower"]),
    ],
)
def test_per_module_policies_plan_each_module_by_its_own(
    policies: dict[str, str], units: list[str], replicated: list[str]
) -> None:
    model = all_frozen_vlm()
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policies)
    plan = parallelizer.plan(model)
    assert unit_paths(plan) == units
    expected = sorted(name for path in replicated for name in param_names(model, path))
    assert sorted(plan.replicated_param_names) == expected
    assert sorted(plan.ignored_param_names) == expected
    record = plan_record(plan)
    assert record is not None
    assert record.policies == parallelizer.frozen_policies
    resolved = {part.path: part.policy for part in record.parts}
    assert set(resolved) == {"vision_tower", PROJECTOR}
    for path, policy in resolved.items():
        assert policy == policies.get(path, policies.get("*", "root"))
        role = "tower" if path == "vision_tower" else "projector"
        assert f"{role} {path!r} (vision): frozen, policy {policy!r}" in plan.notes
    assert (
        plan.notes[0] == f"frozen-tower policies per module: {parallelizer.frozen_policies.label}"
    )


def test_a_mapping_of_one_policy_plans_like_the_string() -> None:
    model = all_frozen_vlm()
    for policy in POLICIES:
        by_string = MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)
        by_default = MultimodalParallelizer(frozen_multimodal_sharding={"*": policy}).plan(model)
        every = {"vision_tower": policy, PROJECTOR: policy}
        by_path = MultimodalParallelizer(frozen_multimodal_sharding=every).plan(model)
        assert by_default == by_string
        assert by_path.calls == by_string.calls
        assert by_path.replicated_param_names == by_string.replicated_param_names


def test_the_attribute_stays_the_default_policy_and_the_label_names_the_rest() -> None:
    plain = MultimodalParallelizer(frozen_multimodal_sharding="Per-Layer")
    assert plain.frozen_policies.default == "per_layer"
    assert plain.frozen_policies.by_path == ()
    assert plain.frozen_policies.label == "per_layer"
    mixed = plain.with_options(
        frozen_multimodal_sharding={"vision_tower": "Per-Layer", "*": " replicate "}
    )
    assert mixed.frozen_policies.default == "replicate"
    assert mixed.frozen_policies.by_path == (("vision_tower", "per_layer"),)
    assert mixed.frozen_policies.label == "vision_tower=per_layer, *=replicate"
    assert plain.frozen_policies.label == "per_layer"  # with_options copies
    # A string clears the per-module entries: the contract's one policy for all.
    assert mixed.with_options(frozen_multimodal_sharding="root").frozen_policies.label == "root"
    assert mixed.with_options(frozen_multimodal_sharding="root").frozen_policies.by_path == ()
    same = MultimodalParallelizer(frozen_multimodal_sharding={"vision_tower": "root"})
    assert same.frozen_policies.label == "root"


def test_a_trainable_module_named_in_the_mapping_is_sharded_normally() -> None:
    model = frozen_vlm()  # the projector is trainable
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding={PROJECTOR: "replicate"})
    plan = parallelizer.plan(model)
    assert unit_paths(plan) == [*TEXT_UNITS, ""]
    assert plan.replicated_param_names == ()
    assert f"projector {PROJECTOR!r} (vision): trainable, sharded like any other module" in (
        plan.notes
    )


def test_an_unknown_path_fails_when_planning_and_lists_the_discovered_ones() -> None:
    parallelizer = MultimodalParallelizer(
        frozen_multimodal_sharding={"vision_tower.blocks": "per_layer", "lm_head": "root"}
    )
    message = (
        r"frozen_multimodal_sharding names 'vision_tower.blocks', 'lm_head', not a discovered "
        r"multimodal module of ToyVLM; discovered: 'vision_tower', 'multi_modal_projector' "
        r"\(use '\*' for the rest\)"
    )
    with pytest.raises(ValueError, match=message):
        parallelizer.plan(all_frozen_vlm())
    # uneven_media plans skip the units but still check the paths.
    uneven = MultimodalParallelizer(frozen_multimodal_sharding={"tower": "root"}, uneven_media=True)
    with pytest.raises(ValueError, match="names 'tower', not a discovered"):
        uneven.plan(all_frozen_vlm())


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            {"vision_tower": "sideways"},
            ValueError,
            r"'vision_tower': unknown frozen multimodal "
            r"sharding 'sideways'; valid choices: root, per_layer, replicate",
        ),
        ({"*": 3}, TypeError, r"'\*': frozen multimodal sharding must be a str, got int"),
        ({1: "root"}, TypeError, r"keys must be module paths \(str\) or '\*', got int \(1\)"),
        ({}, ValueError, r"mapping is empty; give a policy \(root, per_layer, replicate\)"),
    ],
)
def test_bad_mappings_are_refused_at_the_boundary(
    value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        MultimodalParallelizer(frozen_multimodal_sharding=value)  # type: ignore[arg-type]
    base = MultimodalParallelizer(frozen_multimodal_sharding="replicate")
    with pytest.raises(error, match=message):
        base.with_options(frozen_multimodal_sharding=value)  # type: ignore[arg-type]
    assert base.frozen_policies.label == "replicate"


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"vision_tower": "per_layer"}, "'vision_tower'"),
        ({"vision_tower": "root", "*": "per_layer"}, r"'\*'"),
    ],
)
def test_uneven_media_refuses_per_layer_for_any_module(value: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=f"'per_layer' for {named} gives frozen towers one unit"):
        MultimodalParallelizer(frozen_multimodal_sharding=value, uneven_media=True)
    allowed = MultimodalParallelizer(
        frozen_multimodal_sharding={"vision_tower": "replicate"}, uneven_media=True
    )
    assert allowed.plan(all_frozen_vlm()).replicated_param_names == tuple(
        param_names(all_frozen_vlm(), "vision_tower")
    )


def test_apply_mixed_policies_shards_each_module_by_its_own(mesh2: DeviceMesh) -> None:
    model = all_frozen_vlm()
    model.multi_modal_projector.to(torch.bfloat16)
    parallelizer = MultimodalParallelizer(
        frozen_multimodal_sharding={"vision_tower": "per_layer", PROJECTOR: "replicate"}
    )
    parallelizer.parallelize(model, mesh=mesh2, mp_policy=mixed_precision_policy("bf16", "fp32"))
    assert all(isinstance(block, FSDPModule) for block in model.vision_tower.blocks)
    for name, param in model.multi_modal_projector.named_parameters():
        assert not isinstance(param, DTensor), name
        assert param.dtype == torch.bfloat16, name
    assert not any(isinstance(m, FSDPModule) for m in model.multi_modal_projector.modules())
    assert all(isinstance(p, DTensor) for p in model.vision_tower.parameters())
    step(model)
    for name, param in model.named_parameters():
        frozen = name.startswith(("vision_tower.", f"{PROJECTOR}."))
        assert (param.grad is None) == frozen, name
