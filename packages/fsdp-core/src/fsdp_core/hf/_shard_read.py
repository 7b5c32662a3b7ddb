"""This rank's part of a checkpoint tensor: the box of its shard, read as a slice.

``safe_open(...).get_slice`` reads only the region a rank holds, so loading a
sharded model needs no communication; layouts other than ``Shard``/``Replicate``
fall back to reading the tensor whole and keeping the local part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp_core.hf._safetensors_dir import SafeFile
from fsdp_core.hf._slots import Slot
from fsdp_core.materialize import copy_full_into_

#: safetensors dtype codes of floating types (the rest are integers, bool or complex).
_FLOATING_CODES: Final = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def _coordinate(mesh: DeviceMesh) -> tuple[int, ...] | None:
    """This rank's place in ``mesh``, from the process groups FSDP shards over."""
    if not dist.is_initialized():
        return mesh.get_coordinate()
    ranks = tuple(dist.get_rank(mesh.get_group(dim)) for dim in range(mesh.ndim))
    return None if any(rank < 0 for rank in ranks) else ranks


def _local_region(tensor: DTensor) -> tuple[slice, ...] | None:
    """The box of the global tensor this rank holds (``torch.chunk``'s, as FSDP2's), for
    ``Shard``/``Replicate`` layouts; ``None`` otherwise or if it disagrees with the shard."""
    mesh = tensor.device_mesh
    coordinate = _coordinate(mesh)
    if coordinate is None:
        return None
    bounds = [(0, size) for size in tensor.shape]
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            return None
        dim = placement.dim % tensor.dim()
        start, stop = bounds[dim]
        length = stop - start
        chunk = -(-length // mesh.size(mesh_dim))
        low = min(coordinate[mesh_dim] * chunk, length)
        high = min(low + chunk, length)
        bounds[dim] = (start + low, start + high)
    if tuple(high - low for low, high in bounds) != tuple(tensor.to_local().shape):
        return None
    return tuple(slice(low, high) for low, high in bounds)


def _copy_into(target: torch.Tensor, whole: Callable[[], torch.Tensor], part: Any) -> None:
    """``target``'s box of a full tensor: indexed out of ``part`` where the layout has one,
    else taken from ``whole()`` (read whole, the local part kept)."""
    region = _local_region(target) if isinstance(target, DTensor) else None
    if region is None or not isinstance(target, DTensor):
        copy_full_into_(target, whole())
        return
    local = target.to_local()
    with torch.no_grad():
        if local.numel():
            local.copy_(part[region].to(device=local.device, dtype=local.dtype))


def read_into(handle: SafeFile, key: str, slot: Slot) -> str:
    """Copy the checkpoint tensor ``key`` into ``slot`` (only the local shard); its dtype code."""
    lazy = handle.get_slice(key)
    shape, code = tuple(lazy.get_shape()), lazy.get_dtype()
    target = slot.tensor
    if shape != tuple(target.shape):
        raise ValueError(
            f"checkpoint key {key!r} has shape {shape}, the model's {slot.names[0]!r} "
            f"{tuple(target.shape)}"
        )
    if (code in _FLOATING_CODES) != target.dtype.is_floating_point:  # casts stay in a kind
        raise TypeError(
            f"checkpoint key {key!r} holds {code} values but {slot.names[0]!r} is "
            f"{target.dtype}: floating and integer tensors do not convert into each other"
        )
    _copy_into(target, lambda: handle.get_tensor(key), lazy)
    return code


def copy_full(target: torch.Tensor, value: torch.Tensor) -> None:
    """A full tensor into ``target``: this rank's box of it, as the checkpoint reads cut it."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"a full tensor of {tuple(value.shape)} for one of {tuple(target.shape)}")
    _copy_into(target, lambda: value, value)


def code_of(dtype: torch.dtype) -> str:
    """The safetensors dtype code of ``dtype``: a read whose code differs was cast."""
    codes = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    return codes.get(dtype, str(dtype))
