"""Expert parallelism without processes: ParallelDims with ``ep``, the plan of an
EP-sharded model (experts ignored, their gradient hook planned), applying it under the
fake process group, the EP plan's refusals and ``plan --ep``."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_core.fake_group import fake_process_group
from fsdp_core.mesh import MeshShape
from fsdp_core.parallel_dims import ParallelDims
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41, make_batch
from model_deepseek_v41.moe import shard_experts
from multimodal_fsdp.cli.main import main

CONFIG = DeepseekV41Config.tiny(num_experts=4)
EXPERTS = [f"model.layers.{i}.mlp.experts.{name}" for i in range(2) for name in ("down", "gate_up")]


def _ranks(mesh: object) -> list[int]:
    return sorted(int(r) for r in mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]


def test_ep_borrows_data_parallel_ranks_in_the_shape() -> None:
    dims = ParallelDims.from_sizes(dp_shard=2, ep=2)
    assert dims.names == ("dp_shard", "ep")
    assert dims.ep_names == ("ep",)
    # FSDP shards the rest over dp x ep.
    assert dims.dp_shape == MeshShape(dp_replicate=1, dp_shard=4)
    assert dims.expert_replicas == 2
    assert dims.expert_replica_names == ("dp_shard",)
    assert dims.lockstep_names == ("dp_shard", "ep")
    assert dims.data_group_names == ()  # EP ranks hold different batches


@pytest.mark.parametrize("sub_mesh", [False, True])
def test_ep_meshes_from_the_whole_mesh_or_its_dp_sub_mesh(sub_mesh: bool) -> None:
    with fake_process_group(4, rank=3):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        dims = (
            ParallelDims.from_mesh(world["dp"])
            if sub_mesh
            else ParallelDims.from_mesh(world, dp_dims="dp")
        )
        assert _ranks(dims.dp_mesh) == [0, 1, 2, 3]  # dp and ep flattened for FSDP
        assert dims.dp_mesh.ndim == 1
        assert _ranks(dims.expert_replica_mesh) == [1, 3]  # rank 3's ep coordinate
        assert _ranks(dims.expert_mesh) == [2, 3]
        assert dims.lockstep_ranks() == (0, 1, 2, 3)


def _sharded_model(world: object) -> torch.nn.Module:
    model = build_deepseek_v41(CONFIG)
    model.vision.requires_grad_(False)
    assert sorted(shard_experts(model, world["ep"])) == EXPERTS  # type: ignore[index]
    return model


def test_the_plan_keeps_ep_experts_out_of_fsdp_and_reduces_their_gradients() -> None:
    with fake_process_group(4, rank=1):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        model = _sharded_model(world)
        plan = PARALLELIZER.plan(model)
        assert set(EXPERTS) <= set(plan.ignored_param_names)
        assert "replica_grad_reduce" in plan.hook_names()
        (hook,) = [h for h in plan.hooks if h.name == "replica_grad_reduce"]
        assert set(hook.targets) == set(EXPERTS)
        PARALLELIZER.apply_plan(model, plan, mesh=world, dp_dims="dp")
        managed = {
            id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()
        }
        for name in EXPERTS:
            param = model.get_parameter(name)
            assert isinstance(param, DTensor)
            assert param.device_mesh.mesh_dim_names == ("ep",)
            assert param.to_local().shape[0] == 2  # 2 of the 4 experts on each rank
        router = model.get_parameter("model.layers.0.mlp.router.weight")
        assert isinstance(router, DTensor)
        assert id(router) in managed
        assert _ranks(router.device_mesh) == [0, 1, 2, 3]  # the rest: FSDP over all ranks


def test_experts_on_a_mesh_the_library_was_not_given_are_refused() -> None:
    with fake_process_group(4, rank=0):
        experts_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "ep"))
        model = _sharded_model(experts_mesh)
        dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match="has no ep"):
            PARALLELIZER.parallelize(model, mesh=dp)


def test_shard_experts_refusals() -> None:
    with fake_process_group(4, rank=0):
        ep = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        with pytest.raises(ValueError, match="no RoutedExperts"):
            shard_experts(build_deepseek_v41(DeepseekV41Config.tiny()), ep)
        with pytest.raises(ValueError, match=r"ep size 4 does not divide .* 2 experts"):
            shard_experts(build_deepseek_v41(DeepseekV41Config.tiny(num_experts=2)), ep)


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["plan", "--model", "deepseek-v41-moe-tiny", *argv, "--json"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def test_plan_ep_counts_experts_per_ep_shard_and_the_rest_over_every_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ep = _plan_json(capsys, "--world-size", "4", "--ep", "2")
    assert ep["parallel_dims"] == {
        "names": ["dp_shard", "ep"],
        "sizes": [2, 2],
        "dp_names": ["dp_shard"],
    }
    model = build_deepseek_v41(
        DeepseekV41Config.tiny(num_experts=4, expert_intermediate=32), device="meta"
    )
    expert_bytes = sum(model.get_parameter(n).numel() * 4 for n in EXPERTS)
    dense_bytes = sum(p.numel() * 4 for p in model.parameters()) - expert_bytes
    totals, memory = ep["totals"], ep["memory"]
    assert isinstance(totals, dict)
    assert isinstance(memory, dict)
    assert totals["replicated_param_bytes_per_rank"] == expert_bytes // 2  # one ep shard
    assert totals["sharded_param_bytes_per_rank"] == dense_bytes // 4  # FSDP over 4 ranks
    assert memory["gradient_bytes"] == dense_bytes // 4 + expert_bytes // 2
    assert any("expert parallel: 4 ranks as ('dp', 'ep') = (2, 2)" in n for n in ep["notes"])  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--world-size", "8", "--ep", "3"), "--ep 3 does not divide --world-size 8"),
        (("--world-size", "8", "--ep", "2", "--tp", "2"), "not planned together"),
        (("--world-size", "8", "--ep", "8"), "ep size 8 does not divide"),
    ],
)
def test_plan_ep_refusals(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--model", "deepseek-v41-moe-tiny", *argv])
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor"])
def test_torchtitan_ep_gives_the_library_its_sparse_mesh(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """torchtitan's ParallelDims(dp_shard=4, ep=2): the library gets (efsdp, ep) with
    efsdp data-parallel, so FSDP shards the rest over all 4 ranks and an expert's
    gradient is reduced over its efsdp peers."""
    titan = pytest.importorskip("torchtitan.distributed.parallel_dims")
    from fsdp_core.integrations import torchtitan

    monkeypatch.setattr(titan, "device_type", "cpu")
    with fake_process_group(4, rank=1):
        dims = titan.ParallelDims(
            dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=2, world_size=4, spmd_backend=backend
        )
        mesh, dp_dims = torchtitan.sharding_mesh(dims)
        assert (mesh.mesh_dim_names, dp_dims) == (("efsdp", "ep"), ("efsdp",))
        library = ParallelDims.from_mesh(mesh, dp_dims=dp_dims)
        assert library.dp_shape == MeshShape(dp_replicate=1, dp_shard=4)
        assert _ranks(library.dp_mesh) == [0, 1, 2, 3]
        assert _ranks(library.expert_replica_mesh) == [1, 3]
        with pytest.raises(ValueError, match=r"expert_parallel_degree=2.*expert_parallel=fn"):
            torchtitan.parallelize_fn(PARALLELIZER)(
                build_deepseek_v41(CONFIG, device="meta"), parallel_dims=dims
            )


def test_lightning_with_an_expert_parallel_dimension_beside_data_parallel() -> None:
    from fsdp_core.integrations import lightning
    from fsdp_core.runtime import installed_hooks

    with fake_process_group(4, rank=2):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "expert_parallel"))
        model = build_deepseek_v41(CONFIG)
        shard_experts(model, mesh["expert_parallel"])
        lightning.parallelize_fn(PARALLELIZER)(model, mesh)
        expert = model.get_parameter(EXPERTS[0])
        assert isinstance(expert, DTensor)
        assert expert.device_mesh.mesh_dim_names == ("expert_parallel",)
        assert "replica_grad_reduce" in installed_hooks(model)


def test_lightning_refuses_experts_its_mesh_does_not_show() -> None:
    from fsdp_core.integrations import lightning
    from fsdp_core.sharding import is_sharded

    with fake_process_group(4, rank=0):
        strategy_mesh = init_device_mesh(
            "cpu", (4, 1), mesh_dim_names=("data_parallel", "tensor_parallel")
        )
        experts_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        model = build_deepseek_v41(CONFIG)
        shard_experts(model, experts_mesh["ep"])
        with pytest.raises(ValueError, match="no expert-parallel dimension"):
            lightning.parallelize_fn(PARALLELIZER)(model, strategy_mesh)
        assert not is_sharded(model)


def test_the_ep_plan_is_what_one_step_measures() -> None:
    """Under the fake group: the collectives the plan predicts are those measured (the
    replica_grad_reduce all-reduces included), apart from the model's own token exchange
    (an all_to_all there and back per MoE layer, which depends on the routing), and the
    per-rank memory figures match byte for byte, the experts counted by their EP shard."""
    from multimodal_fsdp.measure.comm import measure_plan
    from multimodal_fsdp.measure.memory import measure_plan_memory

    batch = dict(make_batch(CONFIG, batch_size=2, seq_len=24, seed=0))

    def loss(model: torch.nn.Module) -> torch.Tensor:
        value: torch.Tensor = model(**batch)
        return value

    expert_bytes = sum(
        build_deepseek_v41(CONFIG, device="meta").get_parameter(n).numel() * 4 for n in EXPERTS
    )
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        model = _sharded_model(world)
        comm = measure_plan(
            PARALLELIZER.plan(model), model, loss, world_size=4, mesh=world, dp_dims="dp"
        )
    differences = comm.comparison.differences()
    assert differences, "the MoE's own all_to_all is not planned"
    assert all(" all_to_all: expected 0 " in line for line in differences[1:]), differences
    extra = comm.costs.extra
    assert extra.nbytes[("backward", "all_reduce")] >= expert_bytes // 2  # one ep shard
    assert (
        comm.measured.comm.count("all_reduce", "backward")
        == extra.counts[("backward", "all_reduce")]
    )
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        model = _sharded_model(world)
        memory = measure_plan_memory(
            PARALLELIZER.plan(model), model, loss, world_size=4, mesh=world, dp_dims="dp"
        )
    predicted, measured = memory.costs.memory, memory.measured
    assert predicted is not None
    assert predicted.replicated_param_bytes == measured.replicated_param_bytes
    assert measured.replicated_param_bytes >= expert_bytes // 2
    for name in ("sharded_param_bytes", "gradient_bytes", "optimizer_bytes"):
        assert getattr(predicted, name) == getattr(measured, name), name


def test_the_tp_plan_of_a_moe_model_points_to_expert_parallelism() -> None:
    from model_deepseek_v41.tensor_parallel import deepseek_v41_tp_plan

    model = build_deepseek_v41(CONFIG, device="meta")
    with pytest.raises(ValueError, match="routed experts, sharded by expert parallelism"):
        deepseek_v41_tp_plan(model, tp_size=2)
    assert all(
        p.startswith("vision.") for p in deepseek_v41_tp_plan(model, tp_size=2, include_vision=True)
    )


def test_ep_beside_hsdp_folds_ep_into_the_shard_dimension() -> None:
    """(dp_replicate, dp_shard, ep) = 2x2x2: FSDP's mesh is (dp_replicate, dp_shard x ep),
    an expert shard is replicated over dp_replicate x dp_shard."""
    with fake_process_group(8, rank=5):
        world = init_device_mesh(
            "cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "ep")
        )
        dims = ParallelDims.from_mesh(world, dp_dims=("dp_replicate", "dp_shard"))
        assert dims.dp_shape == MeshShape(dp_replicate=2, dp_shard=4)
        assert dims.dp_mesh.ndim == 2
        assert dims.expert_replicas == 4
        assert _ranks(dims.expert_replica_mesh) == [1, 3, 5, 7]  # rank 5: ep coordinate 1
        model = _sharded_model(world)
        PARALLELIZER.parallelize(model, mesh=world, dp_dims=("dp_replicate", "dp_shard"))
        router = model.get_parameter("model.layers.0.mlp.router.weight")
        assert isinstance(router, DTensor)
        assert router.device_mesh.ndim == 2  # HSDP over (dp_replicate, dp_shard x ep)
        assert model.get_parameter(EXPERTS[0]).device_mesh.mesh_dim_names == ("ep",)


def test_balance_media_with_ep_costs_rounds_over_every_rank_as_measured() -> None:
    """``balance_media`` on ``('dp', 'ep')`` 2x2 under the fake group: the rounds run
    over all four ranks (``ParallelDims.batch_mesh`` folds ``ep`` in, as the plan's
    costs assume), so the exchange's all-gathers are predicted as measured (before,
    the runtime balanced over ``dp`` alone: the gathers of half the ranks)."""
    from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer
    from multimodal_fsdp.measure.comm import measure_plan

    batch = dict(make_batch(CONFIG, batch_size=2, seq_len=24, seed=0))

    def loss(model: torch.nn.Module) -> torch.Tensor:
        value: torch.Tensor = model(**batch)
        return value

    parallelizer = DeepseekV41ModelParallelizer(
        frozen_multimodal_sharding="root", balance_media=True
    )
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        model = _sharded_model(world)
        comm = measure_plan(
            parallelizer.plan(model), model, loss, world_size=4, mesh=world, dp_dims="dp"
        )
    differences = comm.comparison.differences()
    assert not [line for line in differences if "all_gather" in line], differences
    assert comm.costs.exchange is not None
    predicted = comm.costs.exchange.bytes("all_gather", "forward")
    assert predicted > 0
    assert comm.measured.comm.bytes("all_gather", "forward") >= predicted
