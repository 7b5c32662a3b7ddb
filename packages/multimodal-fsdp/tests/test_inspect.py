"""Unit tests for multimodal_fsdp.estimate.costs: plan accounting on small hand-made models.

No process group: every figure is computed from the plan and the (meta or CPU)
model alone. Hand-computed numbers pin the padding, dtype and reshard rules;
tests/test_plan_vs_measured.py checks the same figures against real steps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fsdp_core import ModelParallelizer, mixed_precision_policy
from fsdp_core.collective_count import CommTally
from fsdp_core.mesh import resolve_mesh_shape
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.estimate.costs import PlanCosts, plan_costs
from multimodal_fsdp.estimate.predict import inspect_model
from multimodal_fsdp.estimate.render import format_bytes
from multimodal_fsdp.estimate.rewrite import ungroup_units
from multimodal_fsdp.reachability import backward_free_paths

MP = mixed_precision_policy("bf16", "fp32")
POLICIES = ("root", "per_layer", "replicate")


# --- models ------------------------------------------------------------------------------


class Block(nn.Module):
    """Odd widths, so FSDP pads dim 0 on most world sizes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc(x)
        return out


class Tower(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(Block(7) for _ in range(depth))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.patch_embed(pixels)
        for block in self.blocks:
            x = block(x)
        return x


class ToyVLM(nn.Module):
    def __init__(self, text_depth: int = 3, tower_depth: int = 3) -> None:
        super().__init__()
        self.vision_tower = Tower(tower_depth)
        self.multi_modal_projector = nn.Linear(7, 9)
        self.layers = nn.ModuleList(Block(9) for _ in range(text_depth))
        self.lm_head = nn.Linear(9, 11, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.multi_modal_projector(self.vision_tower(pixel_values))
        for layer in self.layers:
            x = layer(x)
        loss: torch.Tensor = self.lm_head(x).float().pow(2).mean()
        return loss


def toy(*, frozen_tower: bool = True, device: str = "meta", **sizes: int) -> ToyVLM:
    with torch.device(device):
        model = ToyVLM(**sizes)
    if frozen_tower:
        model.vision_tower.requires_grad_(False)
    return model


def padded(shape: tuple[int, ...], world: int) -> int:
    return math.ceil(shape[0] / world) * world * math.prod(shape[1:])


def block_gathered(dim: int, world: int, itemsize: int) -> int:
    return (padded((dim, dim), world) + padded((dim,), world)) * itemsize


def inspect_planned(
    model: nn.Module,
    *,
    policy: str = "root",
    precision: str = "bf16",
    reduce_precision: str = "fp32",
    reshard_after_forward: bool | int | None = None,
    **options: object,
) -> PlanCosts:
    """Plan ``model`` under ``policy`` and the precisions, then cost the plan."""
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy)  # type: ignore[arg-type]
    plan = parallelizer.plan(
        model,
        mp_policy=mixed_precision_policy(precision, reduce_precision),
        reshard_after_forward=reshard_after_forward,
    )
    label = f"param={precision} reduce={reduce_precision}"
    return inspect_model(plan, model, precision=label, **options)  # type: ignore[arg-type]


def costs_for(policy: str, world: int = 4, **kwargs: object) -> PlanCosts:
    return inspect_planned(toy(), world_size=world, policy=policy, **kwargs)


def unit(costs: PlanCosts, label: str):  # type: ignore[no-untyped-def]
    return next(u for u in costs.units if u.label == label)


# --- exact figures -----------------------------------------------------------------------


def test_padding_dtypes_and_bytes_of_one_unit() -> None:
    costs = inspect_planned(toy(frozen_tower=False), world_size=4, policy="per_layer")
    layer = unit(costs, "layers.0")
    # weight [9, 9] -> 12 rows, bias [9] -> 12: 120 elements.
    assert layer.numel == 90
    assert layer.gathered_bytes == 120 * 2  # bf16 on the wire
    assert layer.sharded_bytes == 120 // 4 * 4  # fp32 storage, one shard
    assert layer.comm.as_dict() == {
        "forward": {"all_gather": {"count": 1, "bytes": 240}},
        "backward": {
            "all_gather": {"count": 1, "bytes": 240},
            "reduce_scatter": {"count": 1, "bytes": 120 * 4},  # fp32 reduction
        },
    }
    assert (layer.compute_dtype, layer.reduce_dtype, layer.storage_dtypes) == (
        "bfloat16",
        "float32",
        ("float32",),
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 64])
def test_padding_follows_the_shard_group_size(world: int) -> None:
    costs = inspect_planned(toy(frozen_tower=False), world_size=world, policy="per_layer")
    assert unit(costs, "layers.1").gathered_bytes == block_gathered(9, world, 2)
    expected = sum(u.sharded_bytes for u in costs.units)
    assert costs.sharded_param_bytes == expected
    if world == 1:
        assert costs.comm.count() == 0  # one rank: nothing to gather or reduce


def test_root_keeps_its_parameters_after_forward() -> None:
    costs = costs_for("per_layer")
    root = unit(costs, "<root>")
    assert root.reshard_after_forward is False
    assert root.comm.count("all_gather", "backward") == 0
    assert root.comm.count("all_gather", "forward") == 1
    # Asked to reshard, the root is gathered again in backward.
    again = costs_for("per_layer", reshard_after_forward=True)
    assert unit(again, "<root>").comm.count("all_gather", "backward") == 1


def test_reshard_false_and_partial_reshard() -> None:
    never = costs_for("per_layer", reshard_after_forward=False, world=8)
    assert never.comm.count("all_gather", "backward") == 0
    partial = costs_for("per_layer", reshard_after_forward=2, world=8)
    layer = unit(partial, "layers.0")
    assert layer.reshard_after_forward == 2
    # Gathered again from the 2-rank post-forward shards: the same full buffer.
    assert layer.comm.bytes("all_gather", "backward") == layer.gathered_bytes
    with pytest.raises(ValueError, match="divisor"):
        costs_for("per_layer", reshard_after_forward=3, world=8)


def test_hsdp_adds_one_all_reduce_of_the_shard_per_reduce_scatter() -> None:
    costs = costs_for("per_layer", world=8, dp_replicate=2)
    assert costs.mesh.dp_shard == 4
    # Besides the unused-params hook's usage flags (one all-reduce per mesh dimension).
    hooks = costs.extra.count("all_reduce", "backward")
    assert hooks == 2
    assert costs.comm.count("all_reduce", "backward") - hooks == costs.comm.count(
        "reduce_scatter", "backward"
    )
    shard_bytes = costs.comm.bytes("all_reduce", "backward") - costs.extra.bytes(
        "all_reduce", "backward"
    )
    assert shard_bytes * 4 == costs.comm.bytes("reduce_scatter", "backward")
    pure = costs_for("per_layer", world=4, dp_replicate=4)  # shard group of one
    assert pure.comm.count("all_gather") == pure.comm.count("reduce_scatter") == 0
    assert pure.comm.count("all_reduce") > 0


# --- frozen-tower policies -----------------------------------------------------------------


def test_per_layer_frozen_tower_is_gathered_once_and_never_reduced() -> None:
    costs = costs_for("per_layer")
    tower = [u for u in costs.units if u.label.startswith("vision_tower.blocks")]
    assert len(tower) == 3
    for item in tower:
        assert item.frozen
        assert not item.runs_backward
        assert item.comm.as_dict() == {
            "forward": {"all_gather": {"count": 1, "bytes": block_gathered(7, 4, 2)}}
        }
    # Without the guard, the projector's unit (the root) would re-gather the last block.
    waste = [u.label for u in costs.units if u.wasted.count()]
    assert waste == ["vision_tower.blocks.2"]
    assert costs.wasted.bytes() == block_gathered(7, 4, 2)
    unguarded = costs_for("per_layer", prefetch_guard=False)
    assert unguarded.comm.count("all_gather", "backward") == (
        costs.comm.count("all_gather", "backward") + 1
    )


def test_replicate_has_no_tower_collective_and_counts_replicated_bytes() -> None:
    costs = costs_for("replicate")
    assert not any(p.startswith("vision_tower") for u in costs.units for p in u.paths)
    tower_numel = sum(p.numel() for p in toy().vision_tower.parameters())
    assert costs.replicated_numel == tower_numel
    assert costs.replicated_param_bytes == tower_numel * 2  # cast to the bf16 compute dtype
    per_layer = costs_for("per_layer")
    tower_bytes = sum(u.comm.bytes() for u in per_layer.units if u.label.startswith("vision_tower"))
    assert per_layer.comm.bytes() - costs.comm.bytes() >= tower_bytes


def test_root_policy_keeps_the_tower_gathered_all_step() -> None:
    root = costs_for("root")
    per_layer = costs_for("per_layer")
    tower = toy().vision_tower
    tower_gathered = sum(padded(tuple(p.shape), 4) * 2 for p in tower.parameters())
    # The tower joins the root unit, which stays gathered from forward to backward.
    assert (
        unit(root, "<root>").gathered_bytes
        == unit(per_layer, "<root>").gathered_bytes
        + tower_gathered
        - padded((7, 5), 4) * 2
        - padded((7,), 4) * 2
    )
    assert root.peak_gathered_backward_bytes > per_layer.peak_gathered_backward_bytes
    assert root.comm.count() < per_layer.comm.count()


def test_peaks_follow_the_timeline_model() -> None:
    model = toy(frozen_tower=False, text_depth=3, tower_depth=1)
    costs = inspect_planned(model, world_size=4, policy="per_layer")
    root = unit(costs, "<root>").gathered_bytes
    block7 = block_gathered(7, 4, 2)
    block9 = block_gathered(9, 4, 2)
    # Forward: the root (kept) plus one layer at a time.
    assert costs.peak_gathered_forward_bytes == root + max(block7, block9)
    # Backward: the running layer plus the one its pre-backward prefetches.
    assert costs.peak_gathered_backward_bytes == root + 2 * block9


# --- backward judgement ------------------------------------------------------------------


def test_backward_free_paths() -> None:
    assert backward_free_paths(toy()) == ["vision_tower"]
    assert backward_free_paths(toy(frozen_tower=False)) == []
    both = toy()
    both.multi_modal_projector.requires_grad_(False)
    assert backward_free_paths(both) == ["vision_tower", "multi_modal_projector"]
    # A trainable patch embedding feeds gradients into the frozen blocks behind it.
    leading = toy(frozen_tower=False)
    leading.vision_tower.blocks.requires_grad_(False)
    assert backward_free_paths(leading) == []


def test_no_backward_override() -> None:
    model = toy()
    plan = MultimodalParallelizer(frozen_multimodal_sharding="per_layer").plan(model, mp_policy=MP)
    judged = plan_costs(plan, model, world_size=4)
    forced = plan_costs(plan, model, world_size=4, with_backward=["vision_tower"])
    assert forced.comm.count("all_gather", "backward") == (
        judged.comm.count("all_gather", "backward") + 3
    )
    assert plan_costs(plan, model, world_size=4, no_backward=[]).comm == forced.comm


def test_plain_model_parallelizer_plans_are_costed_too() -> None:
    model = toy(frozen_tower=False)
    plan = ModelParallelizer().plan(model, mp_policy=MP)
    costs = plan_costs(plan, model, world_size=2)
    assert costs.comm.count("all_gather", "forward") == len(costs.units)
    # The unused-params hook (one all-reduce of the usage flags per backward); the
    # forward agreement meets at the c10d store (no collective).
    assert [(k, costs.extra.count(k)) for k in ("all_reduce", "all_gather")] == [
        ("all_reduce", 1),
        ("all_gather", 0),
    ]
    assert costs.extra.count("all_reduce", "forward") == 0
    assert costs.extra.bytes("all_reduce", "backward") == sum(
        1 for p in model.parameters() if p.requires_grad
    )


def test_ungroup_units_splits_groups() -> None:
    model = toy(frozen_tower=False)
    plan = ModelParallelizer().plan(model, mp_policy=MP)
    assert ungroup_units(plan).unit_labels() == plan.unit_labels()  # nothing grouped
    with pytest.raises(TypeError, match="ShardingPlan"):
        ungroup_units("plan")  # type: ignore[arg-type]


# --- output and validation -----------------------------------------------------------------


def test_format_tree_and_json() -> None:
    costs = costs_for("per_layer")
    text = costs.format()
    assert "<root>" in text
    assert "{0..2} x3" in text
    assert "frozen (no bwd)" in text
    assert "peak gathered params" in text
    assert "forward all_gather" in text
    assert "layers" in costs.format(collapse=False)
    data = json.loads(json.dumps(costs.as_dict()))
    assert data["totals"]["units"] == len(costs.units)
    assert data["totals"]["collectives"]["forward"]["all_gather"]["count"] == len(costs.units)
    assert data["units"][0]["label"] == costs.units[0].label


def test_comm_tally() -> None:
    a, b = CommTally(), CommTally()
    a.add("forward", "all_gather", 10)
    b.add("forward", "all_gather", 10)
    assert a == b
    b.add("backward", "reduce_scatter", 4, count=2)
    assert a != b
    assert a.differences(b) == ["backward reduce_scatter: expected 0 (0 B), got 2 (4 B)"]
    assert b.count() == 3
    assert b.bytes(kind="reduce_scatter") == 4
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024**2) == "3.0 MiB"


def test_bad_arguments() -> None:
    model = toy()
    plan = MultimodalParallelizer().plan(model, mp_policy=MP)
    with pytest.raises(TypeError, match="ShardingPlan"):
        plan_costs("plan", model, world_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        plan_costs(plan, "model", world_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        plan_costs(plan, model)
    with pytest.raises(ValueError, match="not divisible"):
        plan_costs(plan, model, world_size=6, dp_replicate=4)
    with pytest.raises(TypeError, match="MeshShape"):
        plan_costs(plan, model, mesh=(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid choices"):
        inspect_planned(model, world_size=2, policy="sideways")
    with pytest.raises(ValueError, match="valid names"):
        inspect_planned(model, world_size=2, precision="bf17")
    with pytest.raises(TypeError, match="ShardingPlan"):
        inspect_model("plan", model, world_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        inspect_model(plan, "model", world_size=2)  # type: ignore[arg-type]
    assert plan_costs(plan, model, mesh=resolve_mesh_shape(world_size=2)).world_size == 2
    model.lm_head.register_parameter("scale", nn.Parameter(torch.tensor(1.0, device="meta")))
    with pytest.raises(ValueError, match="scalar parameters"):
        plan_costs(MultimodalParallelizer().plan(model, mp_policy=MP), model, world_size=2)


@pytest.mark.parametrize("policy", POLICIES)
def test_meta_and_cpu_models_cost_the_same(policy: str) -> None:
    meta = inspect_planned(toy(), world_size=4, policy=policy)
    cpu = inspect_planned(toy(device="cpu"), world_size=4, policy=policy)
    assert meta.as_dict() == cpu.as_dict()
