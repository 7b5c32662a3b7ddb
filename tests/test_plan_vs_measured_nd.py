"""Plans on N-D meshes: a model whose language-model MLPs TP already sharded.

Under the fake process group (one process, any world size), the library shards the
tiny DeepSeek-V4.1 reference model over the data-parallel dimensions of a
``('dp', 'tp')`` 2x2 mesh (given as the sub-mesh ``world['dp']``) and of a
``('dp_replicate', 'dp_shard', 'tp')`` 2x2x2 mesh (given whole, with ``dp_dims``):
the applied units are the plan's, and the collectives the plan predicts (the units'
from the TP-local shards, the step agreement over every dimension whose ranks run the
forward together) are those measured, count and bytes, per phase and kind (with
``balance_media`` on a frozen tower too: rounds over both data groups, then each data
group's gathers of its ranks' shares); so are the
per-rank memory figures of parameters, gathered parameters, gradients and optimizer
state, and the activations and peak within the tolerances data-parallel plans get.
"""

from __future__ import annotations

import pytest
import torch
from memory_check import check_memory
from tensor_parallel import tensor_parallel_mlps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from vlm import build_vlm, vlm_batches, vlm_loss

from fsdp_core.fake_group import fake_process_group
from fsdp_core.internals import applied_unit_paths
from fsdp_core.parallel_dims import ParallelDims
from model_deepseek_v41 import PARALLELIZER
from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer
from model_deepseek_v41.tensor_parallel import deepseek_v41_tp_plan
from multimodal_fsdp.balance._data_group import HEADER_INTS
from multimodal_fsdp.balance.traffic import SLOT_INTS
from multimodal_fsdp.estimate.predict import inspect_model
from multimodal_fsdp.measure.comm import measure_plan
from multimodal_fsdp.measure.memory import measure_plan_memory
from multimodal_fsdp.tensor_parallel import apply_tensor_parallel

pytestmark = [pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")]

POLICIES = ("root", "per_layer", "replicate")
BATCH = vlm_batches(1, 1)[0][0]

#: (mesh shape, names, what parallelize gets: the dp sub-mesh or dp_dims, lockstep dims)
MESHES = {
    "dp2_tp2_submesh": ((2, 2), ("dp", "tp"), "dp", None, 2),
    "hsdp2x2_tp2_whole": (
        (2, 2, 2),
        ("dp_replicate", "dp_shard", "tp"),
        None,
        ("dp_replicate", "dp_shard"),
        3,
    ),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", list(MESHES))
def test_tp_sharded_model_plan_is_applied_and_its_costs_are_measured(
    case: str, policy: str
) -> None:
    shape, names, sub, dp_dims, _lockstep = MESHES[case]
    world_size = 1
    for size in shape:
        world_size *= size
    with fake_process_group(world_size):
        world = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = build_vlm(dtype=torch.float32, frozen_tower=True)
        tensor_parallel_mlps(model, world["tp"])
        weight = model.get_parameter("model.layers.0.mlp.gate_up.weight")
        assert isinstance(weight, DTensor)  # TP-sharded before the library runs
        parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
        plan = parallelizer.plan(model)
        mesh = world[sub] if sub is not None else world
        measured = measure_plan(
            plan,
            model,
            lambda m: vlm_loss(m, BATCH),
            world_size=world_size,
            mesh=mesh,
            dp_dims=dp_dims,
        )
        applied = sorted(tuple(sorted(paths)) for paths in applied_unit_paths(model))
        # FSDP added the data-parallel dimensions to the TP placement.
        sharded = model.get_parameter("model.layers.0.mlp.gate_up.weight")
        assert isinstance(sharded, DTensor)
        assert sharded.device_mesh.ndim == len(shape)
    assert applied == sorted(tuple(sorted(unit.paths)) for unit in plan.units)
    assert measured.matches, "\n".join(measured.comparison.differences())
    # The forward agreement and the schedule checkpoints meet at the c10d store: no
    # all-reduce in forward, predicted and measured alike, whatever the lockstep dims.
    assert measured.costs.extra.counts.get(("forward", "all_reduce"), 0) == 0
    assert measured.measured.comm.count("all_reduce", "forward") == 0


#: Memory figures the estimate predicts byte for byte (activations: within the
#: tolerances of ``memory_check.check_memory``, as for a data-parallel model).
MEMORY_EXACT = (
    "sharded_param_bytes",
    "replicated_param_bytes",
    "peak_gathered_forward_bytes",
    "peak_gathered_backward_bytes",
    "gradient_bytes",
    "optimizer_bytes",
)


@pytest.mark.parametrize("policy", POLICIES)
def test_tp_sharded_model_memory_is_predicted_from_its_local_shards(policy: str) -> None:
    """Per-rank memory of the TP-sharded model on the ``('dp', 'tp')`` 2x2 mesh with
    AdamW: parameters, gathered parameters, gradients and optimizer state exactly as
    FSDP's memory tracker measures them, activations and the peak within the usual
    tolerances; ``inspect_model`` given the ``ParallelDims`` predicts the same."""
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build_vlm(dtype=torch.float32, frozen_tower=True)
        tensor_parallel_mlps(model, world["tp"])
        plan = PARALLELIZER.with_options(frozen_multimodal_sharding=policy).plan(model)
        dims = ParallelDims.from_mesh(world["dp"])
        inspected = inspect_model(plan, model, mesh=dims, optimizer="adamw").memory
        result = measure_plan_memory(
            plan, model, lambda m: vlm_loss(m, BATCH), world_size=4, mesh=world["dp"]
        )
    predicted, measured = result.costs.memory, result.measured
    assert predicted is not None
    assert inspected is not None
    for name in MEMORY_EXACT:
        assert getattr(predicted, name) == getattr(measured, name), name
        assert getattr(inspected, name) == getattr(measured, name), name
    check_memory(result)


@pytest.mark.parametrize("policy", POLICIES)
def test_balanced_frozen_tower_on_tp_ranks_costs_what_is_measured(policy: str) -> None:
    """``balance_media`` on the ``('dp', 'tp')`` 2x2 mesh: the rounds span both data
    groups (4 ranks) and each data group gathers its shares' outputs after every
    balanced call; the plan predicts those collectives, count and bytes, as measured."""
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build_vlm(dtype=torch.float32, frozen_tower=True)
        tensor_parallel_mlps(model, world["tp"])
        parallelizer = DeepseekV41ModelParallelizer(
            frozen_multimodal_sharding=policy, balance_media=True
        )
        plan = parallelizer.plan(model)
        measured = measure_plan(
            plan, model, lambda m: vlm_loss(m, BATCH), world_size=4, mesh=world["dp"]
        )
    assert measured.costs.balanced_towers == ("vision",)
    assert measured.matches, "\n".join(measured.comparison.differences())
    # The batch's one tower call of 2 images, each encoded to 1 row of (4, 4, 64) float32:
    # its round and the barrier's over both data groups (4 ranks), then rank 0's data
    # group gathers the fixed headers and the two shares' outputs.
    assert measured.costs.exchange is not None
    assert measured.costs.exchange.as_dict() == {
        "forward": {
            "all_gather": {
                "count": 2 + 2,
                "bytes": 2 * 4 * SLOT_INTS * 8 + 2 * HEADER_INTS * 8 + 2 * (4 * 4 * 64 * 4),
            }
        }
    }


def test_balanced_trainable_tower_on_tp_ranks_costs_what_is_measured() -> None:
    """A trainable tower balanced on the ``('dp', 'tp')`` 2x2 mesh: the ranks of a TP
    data group split its images, and the ``replica_grad_reduce`` hook sums the tower's
    gradients over the data group, one all-reduce of each tower parameter per backward;
    the plan predicts it (count and bytes) as measured under the fake group."""
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build_vlm(dtype=torch.float32, frozen_tower=False)
        tensor_parallel_mlps(model, world["tp"])
        tower = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        tower = {n: b for n, b in tower.items() if n.startswith("vision.")}
        parallelizer = DeepseekV41ModelParallelizer(
            frozen_multimodal_sharding="per_layer", balance_media=True
        )
        plan = parallelizer.plan(model)
        (hook,) = [h for h in plan.hooks if h.name == "replica_grad_reduce"]
        assert sorted(hook.targets) == sorted(tower)
        measured = measure_plan(
            plan, model, lambda m: vlm_loss(m, BATCH), world_size=4, mesh=world["dp"]
        )
    assert measured.matches, "\n".join(measured.comparison.differences())
    # Backward all-reduces: the hook's (one per tower parameter, its fp32 bytes) and the
    # unused-params flags' (one, 1 byte per trainable parameter tensor).
    flags = sum(1 for p in model.parameters() if p.requires_grad)
    predicted = measured.costs.extra
    assert predicted.count("all_reduce", "backward") == len(tower) + 1
    assert predicted.bytes("all_reduce", "backward") == sum(tower.values()) + flags
    assert measured.measured.comm.count("all_reduce", "backward") == len(tower) + 1
    assert measured.measured.comm.bytes("all_reduce", "backward") == sum(tower.values()) + flags


@pytest.mark.parametrize("trainable", [False, True])
def test_balanced_tensor_parallel_tower_costs_what_is_measured(trainable: bool) -> None:
    """The vision tower's MLPs tensor-parallel over ``tp`` too
    (``deepseek_v41_tp_plan(include_vision=True)``), frozen (``root``) or trainable: the
    plan records it (``sharded_on_data_group``), so the ranks of a TP group run the same
    items: the rounds span the data-parallel ranks only (2), no data-group gather, and no
    ``replica_grad_reduce``; predicted as measured under the fake group."""
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build_vlm(dtype=torch.float32, frozen_tower=not trainable)
        tp_plan = deepseek_v41_tp_plan(model, tp_size=2, include_vision=True, include_frozen=True)
        apply_tensor_parallel(model, world["tp"], tp_plan)
        plan = DeepseekV41ModelParallelizer(
            frozen_multimodal_sharding="per_layer" if trainable else "root", balance_media=True
        ).plan(model)
        (balance,) = [h for h in plan.hooks if h.name == "balance_media"]
        assert balance.hook.sharded_on_data_group == ("vision",)  # type: ignore[union-attr]
        assert "not shared with the TP or CP ranks" in balance.reason
        assert "replica_grad_reduce" not in {h.name for h in plan.hooks}
        measured = measure_plan(
            plan, model, lambda m: vlm_loss(m, BATCH), world_size=4, mesh=world["dp"]
        )
    assert measured.matches, "\n".join(measured.comparison.differences())
    # The batch's one tower call of 2 images, every item home: its round's slot gather
    # and the barrier's, over the 2 data-parallel ranks; no data-group gather.
    assert measured.costs.exchange is not None
    assert measured.costs.exchange.as_dict() == {
        "forward": {"all_gather": {"count": 2, "bytes": 2 * 2 * SLOT_INTS * 8}}
    }


@pytest.mark.parametrize("images", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_balanced_tower_on_tp_ranks_memory_is_predicted(images: int, policy: str) -> None:
    """``balance_media`` on the ``('dp', 'tp')`` 2x2 mesh: each rank of a TP group encodes
    its share of the call and the data group gathers the shares' outputs. The memory
    model traces the share and the gather's buffers (held byte for byte to the gather
    in ``tests/test_data_group_memory.py``); here the whole step against FSDP's memory
    tracker, within the tolerances data-parallel plans get."""
    batch = vlm_batches(1, 1, images=[images])[0][0]
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build_vlm(dtype=torch.float32, frozen_tower=True)
        tensor_parallel_mlps(model, world["tp"])
        plan = DeepseekV41ModelParallelizer(
            frozen_multimodal_sharding=policy, balance_media=True
        ).plan(model)
        result = measure_plan_memory(
            plan, model, lambda m: vlm_loss(m, batch), world_size=4, mesh=world["dp"]
        )
    assert result.costs.exchange is not None  # the gathers were costed
    check_memory(result)


def test_balanced_tensor_parallel_tower_memory_is_predicted() -> None:
    """The frozen tower's MLPs tensor-parallel over ``tp`` too: no data group shares its
    encoding, so the memory model traces each rank encoding its data-parallel rank's
    whole call (no share, no gather); against FSDP's memory tracker, within the
    tolerances data-parallel plans get."""
    batch = vlm_batches(1, 1, images=[4])[0][0]
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build_vlm(dtype=torch.float32, frozen_tower=True)
        tp_plan = deepseek_v41_tp_plan(model, tp_size=2, include_vision=True, include_frozen=True)
        apply_tensor_parallel(model, world["tp"], tp_plan)
        plan = DeepseekV41ModelParallelizer(
            frozen_multimodal_sharding="root", balance_media=True
        ).plan(model)
        result = measure_plan_memory(
            plan, model, lambda m: vlm_loss(m, batch), world_size=4, mesh=world["dp"]
        )
    assert result.costs.exchange is not None
    check_memory(result)
