"""ParallelDims: what the caller's mesh says about the job's parallel dimensions."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_core.fake_group import fake_process_group
from fsdp_core.mesh import MeshShape
from fsdp_core.parallel_dims import ParallelDims, dimension_role


def test_shape_only_dims_answer_sizes_and_groups_of_dimensions() -> None:
    dims = ParallelDims.from_sizes(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    assert dims.names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert dims.dp_names == ("dp_replicate", "dp_shard")
    assert dims.dp_shape == MeshShape(dp_replicate=2, dp_shard=2)
    assert dims.world_size == 16
    assert dims.other_dims == {"pp": 2, "tp": 2}
    assert dims.lockstep_names == ("dp_replicate", "dp_shard", "tp")
    assert dims.data_group_names == ("tp",)
    assert (dims.dp_dims, dims.lockstep_dims) == (2, 3)
    assert dims.role_size("tp") == 2
    assert dims.role_size("cp") == 1
    assert not dims.is_data_parallel_only
    with pytest.raises(ValueError, match="without a mesh"):
        _ = dims.dp_mesh


def test_data_parallel_only_dims_keep_their_mesh_as_the_lockstep_mesh() -> None:
    dims = ParallelDims.from_sizes(dp_shard=4, pp=1, tp=1)
    assert dims.names == ("dp_shard",)
    assert dims.is_data_parallel_only
    assert dims.lockstep_dims == dims.dp_dims == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"names": ("dp", "dp"), "sizes": (2, 2), "dp_names": ("dp",)}, "repeat"),
        ({"names": ("dp",), "sizes": (0,), "dp_names": ("dp",)}, "positive"),
        ({"names": ("dp", "tp"), "sizes": (2, 2), "dp_names": ("x",)}, r"\('dp', 'tp'\)"),
        ({"names": ("dp", "foo"), "sizes": (2, 2), "dp_names": ("dp",)}, "foo=2"),
        ({"names": ("a", "b", "c"), "sizes": (1, 1, 1), "dp_names": ("a", "b", "c")}, "one"),
        # CP ranks hold the same batch; FSDP already shards over cp with dp.
        ({"names": ("dp", "cp"), "sizes": (2, 2), "dp_names": ("dp", "cp")}, r"dp_dims='dp'"),
    ],
)
def test_invalid_dims_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)  # type: ignore[arg-type]


def test_a_single_rank_dimension_of_any_name_is_accepted() -> None:
    dims = ParallelDims(names=("dp", "foo"), sizes=(2, 1), dp_names=("dp",))
    assert dims.lockstep_names == ("dp",)


def test_roles_come_from_short_and_long_names() -> None:
    assert dimension_role("tp") == dimension_role("tensor_parallel") == "tp"
    assert dimension_role("pipeline_parallel") == "pp"
    assert dimension_role("dp_shard") is None


def test_a_data_parallel_sub_mesh_finds_the_other_dimensions_of_its_mesh() -> None:
    with fake_process_group(8, rank=5):
        world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        dp = world["dp"]
        dims = ParallelDims.from_mesh(dp)
        assert dims.dp_mesh is dp  # the caller's mesh, as FSDP gets it
        assert dims.names == ("pp", "dp", "tp")
        assert dims.dp_names == ("dp",)
        # rank 5 = (pp 1, dp 0, tp 1): its stage's ranks run the forward together,
        # its TP group holds its batch.
        assert dims.lockstep_ranks() == (4, 5, 6, 7)
        assert dims.data_group_ranks() == (4, 5)
        assert dims.lockstep_mesh.mesh_dim_names == ("dp", "tp")


def test_the_whole_mesh_with_named_data_parallel_dimensions() -> None:
    with fake_process_group(8, rank=3):
        world = init_device_mesh(
            "cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
        )
        dims = ParallelDims.from_mesh(world, dp_dims=("dp_replicate", "dp_shard"))
        assert dims.dp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert dims.dp_shape == MeshShape(dp_replicate=2, dp_shard=2)
        assert dims.lockstep_mesh is world
        assert dims.lockstep_ranks() == tuple(range(8))
        assert dims.data_group_ranks() == (2, 3)
        same = ParallelDims.from_mesh(world["dp_replicate", "dp_shard"])
        assert same == dims  # the same dimensions, either way they are given
        # dp_replicate left out of the data-parallel dimensions has no known role.
        with pytest.raises(ValueError, match="dp_replicate=2 that are neither"):
            ParallelDims.from_mesh(world, dp_dims="dp_shard")


def test_a_plain_data_parallel_mesh_is_its_own_lockstep_mesh() -> None:
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        dims = ParallelDims.from_mesh(mesh)
        assert dims.dp_mesh is mesh
        assert dims.lockstep_mesh is mesh
        assert dims.data_group_mesh is None
        assert dims.data_group_ranks() == (0,)
        unnamed = init_device_mesh("cpu", (4,))
        assert ParallelDims.from_mesh(unnamed).dp_names == ("dp_shard",)


@pytest.mark.parametrize(
    ("dp_dims", "error", "match"),
    [
        ("x", ValueError, r"\['x'\] are not dimensions of the mesh; its dimensions are"),
        (("tp", "dp"), ValueError, "not in the mesh's order"),
        (("dp", "dp"), ValueError, "repeats"),
        (("pp", "dp", "tp"), ValueError, "one"),
        (3, TypeError, "dp_dims must be"),
    ],
)
def test_bad_dp_dims_are_refused_with_the_mesh_names(
    dp_dims: object, error: type[Exception], match: str
) -> None:
    with fake_process_group(8):
        world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        with pytest.raises(error, match=match):
            ParallelDims.from_mesh(world, dp_dims=dp_dims)  # type: ignore[arg-type]


def test_a_mesh_that_is_not_data_parallel_is_refused() -> None:
    with fake_process_group(8):
        world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        with pytest.raises(ValueError, match="not a data-parallel mesh"):
            ParallelDims.from_mesh(world)
        with pytest.raises(ValueError, match=r"\['tp'\] are named for tensor"):
            ParallelDims.from_mesh(world["dp", "tp"])
        with pytest.raises(TypeError, match="DeviceMesh"):
            ParallelDims.from_mesh("dp")  # type: ignore[arg-type]


def test_dp_dims_need_a_mesh_with_names() -> None:
    with fake_process_group(4), pytest.raises(ValueError, match="no dimension names"):
        ParallelDims.from_mesh(init_device_mesh("cpu", (4,)), dp_dims="dp")


def test_a_flattened_data_parallel_mesh_keeps_its_own_dimensions() -> None:
    """A mesh flattened from others (torchtitan's ``dp_shard_cp``) names no dimension of
    its root: the other dimensions are not known, so the data-parallel mesh is all
    (as before N-D support); the whole mesh with ``dp_dims`` names them."""
    with fake_process_group(8, rank=2):
        world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
        flat = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        dims = ParallelDims.from_mesh(flat)
        assert dims.names == ("dp_shard_cp",)
        assert dims.dp_mesh is flat
        assert dims.lockstep_mesh is flat
        assert dims.lockstep_ranks() == (0, 2, 4, 6)


def test_local_shape_is_the_shard_a_rank_holds() -> None:
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_core.parallel_dims import local_shape

    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        weight = nn.Parameter(distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]))
        assert tuple(weight.shape) == (8, 6)
        assert tuple(local_shape(weight)) == (8, 3)
        assert tuple(local_shape(torch.zeros(4, 2))) == (4, 2)
