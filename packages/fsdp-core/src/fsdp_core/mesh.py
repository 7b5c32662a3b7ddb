"""DeviceMesh construction for FSDP (1-D) and HSDP (2-D) data parallelism, and the small
agreements runtime hooks make over the data-parallel ranks of a mesh (not the world)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_core.distributed import device_type_for_backend

__all__ = [
    "SHARD_DIM",
    "REPLICATE_DIM",
    "MeshShape",
    "resolve_mesh_shape",
    "build_mesh",
    "mesh_device",
    "mesh_groups",
    "all_reduce_max_over_mesh",
]

SHARD_DIM: Final[str] = "dp_shard"
REPLICATE_DIM: Final[str] = "dp_replicate"


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value == 0 or value < -1:
        raise ValueError(f"{name}={value} is invalid: use a positive size or -1 to infer it")
    return value


@dataclass(frozen=True)
class MeshShape:
    """Resolved data-parallel sizes; ``dp_replicate == 1`` means a plain 1-D FSDP mesh."""

    dp_replicate: int
    dp_shard: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def is_hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dim_names(self) -> tuple[str, ...]:
        return (REPLICATE_DIM, SHARD_DIM) if self.is_hsdp else (SHARD_DIM,)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard) if self.is_hsdp else (self.dp_shard,)


def resolve_mesh_shape(*, world_size: int, dp_replicate: int = 1, dp_shard: int = -1) -> MeshShape:
    """Fill in a ``-1`` size from ``world_size`` and check that the sizes multiply to it.

    Args:
        world_size: the number of ranks the mesh spans.
        dp_replicate: replicate-group size, or ``-1`` to infer it.
        dp_shard: shard-group size, or ``-1`` to infer it.

    Returns:
        Both sizes, resolved.

    Raises:
        TypeError: ``world_size`` is not an int.
        ValueError: a size is invalid, both are ``-1``, or their product is not
            ``world_size``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    replicate = _check_size("dp_replicate", dp_replicate)
    shard = _check_size("dp_shard", dp_shard)
    if replicate == -1 and shard == -1:
        raise ValueError("at most one of dp_replicate and dp_shard may be -1 (inferred)")
    if replicate == -1 or shard == -1:
        known = shard if replicate == -1 else replicate
        if world_size % known:
            raise ValueError(
                f"cannot infer a mesh size: world size {world_size} is not divisible by {known}"
            )
        inferred = world_size // known
        replicate, shard = (inferred, shard) if replicate == -1 else (replicate, inferred)
    if replicate * shard != world_size:
        raise ValueError(
            f"dp_replicate ({replicate}) * dp_shard ({shard}) = {replicate * shard} "
            f"does not match the world size {world_size}"
        )
    return MeshShape(dp_replicate=replicate, dp_shard=shard)


def build_mesh(
    *,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    device_type: str | None = None,
) -> DeviceMesh:
    """Build the data-parallel mesh over the default process group.

    The device type follows the backend (``cuda`` for NCCL, ``cpu`` for gloo and fake): a
    ``device_type`` that disagrees is refused rather than give collectives that cannot run.

    Args:
        dp_replicate: replicate-group size (``> 1`` makes an HSDP mesh), or ``-1``.
        dp_shard: shard-group size, or ``-1`` to infer it from the world size.
        device_type: ``"cuda"`` or ``"cpu"``; None follows the backend.

    Returns:
        A 1-D ``("dp_shard",)`` or 2-D ``("dp_replicate", "dp_shard")`` mesh.

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: the sizes do not fit the world, or ``device_type`` disagrees with
            the backend.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh() needs a process group: call init_distributed() first")
    shape = resolve_mesh_shape(
        world_size=dist.get_world_size(), dp_replicate=dp_replicate, dp_shard=dp_shard
    )
    backend_device = device_type_for_backend(str(dist.get_backend()))
    if device_type is not None and device_type != backend_device:
        raise ValueError(
            f"device_type {device_type!r} does not match the {dist.get_backend()!r} process "
            f"group (which runs on {backend_device!r}); pass {backend_device!r} or None"
        )
    return init_device_mesh(backend_device, shape.sizes, mesh_dim_names=shape.dim_names)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a collective over ``mesh`` needs its tensors on.

    Args:
        mesh: a device mesh.

    Returns:
        This rank's device of the mesh's device type.
    """
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def mesh_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, ...]:
    """One process group per mesh dimension (size-1 dimensions left out).

    Args:
        mesh: a device mesh.

    Returns:
        The process groups of its dimensions of size > 1.
    """
    return tuple(mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1)


def all_reduce_max_over_mesh(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over every rank of ``mesh``, in place.

    How runtime hooks agree on flags over exactly the ranks that share the model's
    collectives: one all-reduce per mesh dimension larger than one (a maximum of maxima).

    Args:
        tensor: the values to agree on (on the mesh's device).
        mesh: the ranks that must agree.

    Returns:
        ``tensor``, now holding the maximum over the mesh.
    """
    for group in mesh_groups(mesh):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor
