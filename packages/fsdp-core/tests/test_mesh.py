"""fsdp_core.mesh: mesh shapes and DeviceMesh construction over the default group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core.fake_group import fake_process_group
from fsdp_core.mesh import REPLICATE_DIM, SHARD_DIM, MeshShape, build_mesh, resolve_mesh_shape

# MeshShape ---------------------------------------------------------------------------------------


def test_mesh_shape_1d() -> None:
    shape = MeshShape(dp_replicate=1, dp_shard=8)
    assert shape.world_size == 8
    assert not shape.is_hsdp
    assert shape.dim_names == ("dp_shard",) == (SHARD_DIM,)
    assert shape.sizes == (8,)


def test_mesh_shape_hsdp() -> None:
    shape = MeshShape(dp_replicate=2, dp_shard=4)
    assert shape.world_size == 8
    assert shape.is_hsdp
    assert shape.dim_names == ("dp_replicate", "dp_shard") == (REPLICATE_DIM, SHARD_DIM)
    assert shape.sizes == (2, 4)


# resolve_mesh_shape ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"world_size": 8}, (1, 8)),
        ({"world_size": 8, "dp_replicate": 2}, (2, 4)),
        ({"world_size": 8, "dp_replicate": -1, "dp_shard": 4}, (2, 4)),
        ({"world_size": 8, "dp_replicate": -1, "dp_shard": 8}, (1, 8)),
        ({"world_size": 8, "dp_replicate": 8, "dp_shard": 1}, (8, 1)),
        ({"world_size": 6, "dp_replicate": 3, "dp_shard": 2}, (3, 2)),
        ({"world_size": 1}, (1, 1)),
    ],
)
def test_resolve_mesh_shape(kwargs: dict[str, int], expected: tuple[int, int]) -> None:
    shape = resolve_mesh_shape(**kwargs)
    assert (shape.dp_replicate, shape.dp_shard) == expected
    assert shape.world_size == kwargs["world_size"]


def test_resolve_mesh_shape_product_mismatch() -> None:
    with pytest.raises(
        ValueError,
        match=r"dp_replicate \(2\) \* dp_shard \(2\) = 4 does not match the world size 8",
    ):
        resolve_mesh_shape(world_size=8, dp_replicate=2, dp_shard=2)


@pytest.mark.parametrize(
    ("kwargs", "known"),
    [({"dp_replicate": 3}, 3), ({"dp_replicate": -1, "dp_shard": 5}, 5)],
)
def test_resolve_mesh_shape_cannot_infer(kwargs: dict[str, int], known: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"cannot infer a mesh size: world size 8 is not divisible by {known}",
    ):
        resolve_mesh_shape(world_size=8, **kwargs)


@pytest.mark.parametrize("name", ["dp_replicate", "dp_shard"])
@pytest.mark.parametrize("value", [0, -2, -8])
def test_resolve_mesh_shape_bad_sizes(name: str, value: int) -> None:
    with pytest.raises(
        ValueError, match=rf"{name}={value} is invalid: use a positive size or -1 to infer it"
    ):
        resolve_mesh_shape(world_size=8, **{name: value})


def test_resolve_mesh_shape_two_inferred_sizes() -> None:
    with pytest.raises(ValueError, match=r"at most one of dp_replicate and dp_shard may be -1"):
        resolve_mesh_shape(world_size=8, dp_replicate=-1, dp_shard=-1)


@pytest.mark.parametrize("name", ["world_size", "dp_replicate", "dp_shard"])
@pytest.mark.parametrize("value", [True, False, 2.0, "2", None])
def test_resolve_mesh_shape_sizes_must_be_ints(name: str, value: object) -> None:
    kwargs: dict[str, object] = {"world_size": 2, name: value}
    with pytest.raises(TypeError, match=rf"{name} must be an int, got {type(value).__name__}"):
        resolve_mesh_shape(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world_size", "match"),
    [
        (0, r"world_size must be positive, got 0"),
        (-1, r"world_size must be positive, got -1"),
        (-3, r"world_size must be positive, got -3"),
    ],
)
def test_resolve_mesh_shape_bad_world_size(world_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_mesh_shape(world_size=world_size)


# build_mesh --------------------------------------------------------------------------------------


def test_build_mesh_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"needs a process group: call init_distributed"):
        build_mesh()


def test_build_mesh_1d(fake_pg4: None) -> None:
    mesh = build_mesh()
    assert isinstance(mesh, DeviceMesh)
    assert mesh.device_type == "cpu"
    assert mesh.mesh_dim_names == ("dp_shard",)
    assert mesh.ndim == 1
    assert mesh.size() == 4


def test_build_mesh_explicit_matching_device_type(fake_pg4: None) -> None:
    mesh = build_mesh(dp_shard=4, device_type="cpu")
    assert mesh.mesh_dim_names == ("dp_shard",)
    assert mesh.device_type == "cpu"


def test_build_mesh_hsdp(fake_pg4: None) -> None:
    mesh = build_mesh(dp_replicate=2)
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert tuple(mesh.shape) == (2, 2)
    assert mesh["dp_shard"].size() == 2
    assert mesh["dp_replicate"].size() == 2


def test_build_mesh_hsdp_inferred_replicate(fake_pg4: None) -> None:
    mesh = build_mesh(dp_replicate=-1, dp_shard=2)
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert tuple(mesh.shape) == (2, 2)


def test_build_mesh_refuses_cuda_over_fake_group(fake_pg4: None) -> None:
    with pytest.raises(
        ValueError,
        match=r"device_type 'cuda' does not match the 'fake' process group "
        r"\(which runs on 'cpu'\); pass 'cpu' or None",
    ):
        build_mesh(device_type="cuda")


def test_build_mesh_refuses_cuda_over_gloo() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"device_type 'cuda' does not match the 'gloo'"):
            build_mesh(device_type="cuda")
        assert build_mesh().mesh_dim_names == ("dp_shard",)
    finally:
        dist.destroy_process_group()


def test_build_mesh_checks_the_shape(fake_pg4: None) -> None:
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by 3"):
        build_mesh(dp_replicate=3)
    with pytest.raises(ValueError, match=r"does not match the world size 4"):
        build_mesh(dp_replicate=2, dp_shard=4)


@pytest.fixture
def device_qualified_gloo() -> Iterator[None]:
    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_build_mesh_over_device_qualified_backend(device_qualified_gloo: None) -> None:
    assert dist.get_backend() == "cpu:gloo"
    mesh = build_mesh()
    assert mesh.device_type == "cpu"


def test_fake_group_sizes_carry_into_mesh() -> None:
    for world_size in (1, 2, 8):
        with fake_process_group(world_size):
            assert build_mesh().size() == world_size
