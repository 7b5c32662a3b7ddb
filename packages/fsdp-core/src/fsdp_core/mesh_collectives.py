"""Small agreements over the data-parallel ranks of a mesh (not the whole world).

Runtime hooks agree on tiny flags (which parameters some rank used, where each rank
is in its forward). They must agree over exactly the ranks that share the model's
collectives: the data-parallel mesh, which may be a part of a larger world (other
mesh dimensions for tensor or pipeline parallelism). A reduction over each mesh
dimension in turn covers the whole mesh with public API only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["mesh_device", "mesh_groups", "all_reduce_max_over_mesh"]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a collective over ``mesh`` needs its tensors on."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def mesh_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, ...]:
    """One process group per mesh dimension (size-1 dimensions left out)."""
    groups = []
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            groups.append(mesh.get_group(dim))
    return tuple(groups)


def all_reduce_max_over_mesh(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over every rank of ``mesh``, in place.

    One all-reduce per mesh dimension larger than one; the maximum over the
    replicate groups of the maxima over the shard groups is the maximum over all.
    """
    for group in mesh_groups(mesh):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor
