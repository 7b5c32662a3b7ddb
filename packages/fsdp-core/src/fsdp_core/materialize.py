"""Materialise a model built on the meta device and sharded, with the right values.

``reset_parameters()`` on sharded DTensors draws random numbers per shard (on a CPU mesh
every rank draws the *same* shard). Two correct ways, both collective (every rank must
arrive within ``timeout=``; a failure on any rank is raised on every rank):

- [`materialize_from_full`][fsdp_core.materialize.materialize_from_full]: every rank
  computes the full initial tensors deterministically and keeps its own shard.
- [`load_full_state_dict`][fsdp_core.materialize.load_full_state_dict]: rank 0 holds a
  full state dict and broadcasts it into the shards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_core.collective_entry import enter_collective, group_ranks, whole_world_ranks
from fsdp_core.weights_check import mark_written, refill_unset_buffers

__all__ = ["copy_full_into_", "load_full_state_dict", "materialize_from_full"]

logger = logging.getLogger(__name__)


def copy_full_into_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full tensor into ``param``: only the local shard when it is a DTensor.

    Args:
        param: a parameter or buffer, plain or a DTensor shard.
        full: its full (unsharded) value.

    Raises:
        ValueError: the shapes differ.
    """
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(
            f"full tensor of shape {tuple(full.shape)} for a parameter of {tuple(param.shape)}"
        )
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full.to(device=param.device_mesh.device_type, dtype=param.dtype),
                param.device_mesh,
                param.placements,
                src_data_rank=None,  # every rank holds the same full tensor: slice, no comms
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full.to(device=param.device, dtype=param.dtype))
    mark_written(param)  # a local write that the DTensor's version does not show


def materialize_from_full(
    model: nn.Module,
    full_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    device: torch.device | str,
    buffers: Mapping[str, torch.Tensor] | None = None,
    timeout: float | timedelta | None = None,
) -> nn.Module:
    """Allocate ``model`` on ``device`` and fill it from ``(name, full tensor)`` pairs.

    Every parameter must receive a value; the result is bit-identical to loading the
    same full tensors into an unsharded model. Collective.

    Args:
        model: a sharded model on the meta device.
        full_tensors: ``(name, full tensor)`` for every parameter (and buffer).
        device: where the model is allocated.
        buffers: values for buffers ``full_tensors`` does not give.
        timeout: the arrival check's timeout (the process group's if None).

    Returns:
        ``model``, allocated and filled.

    Raises:
        ValueError: a parameter got no value (on every rank).
    """
    with enter_collective(
        "materialize_from_full", ranks=group_ranks(model=model), timeout=timeout
    ) as call:
        call.run(
            lambda: _materialize(model, full_tensors, device=device, buffers=buffers),
            step="filling the shards",
        )
        # Non-persistent buffers not given: recomputed for transformers models.
        call.run(lambda: refill_unset_buffers(model), step="recomputing buffers")
        return model


def _materialize(
    model: nn.Module,
    full_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    device: torch.device | str,
    buffers: Mapping[str, torch.Tensor] | None,
) -> None:
    model.to_empty(device=device)
    named = dict(model.named_parameters())
    seen: set[str] = set()
    for name, full in full_tensors:
        if name not in named:
            raise ValueError(f"{name!r} is not a parameter of {type(model).__name__}")
        copy_full_into_(named[name], full)
        seen.add(name)
    missing = sorted(set(named) - seen)
    if missing:
        raise ValueError(f"no initial value for {len(missing)} parameters: {missing[:8]}")
    for name, value in (buffers or {}).items():
        buffer = model.get_buffer(name)
        with torch.no_grad():
            buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))
    logger.info("materialised %d parameters on %s", len(named), device)


def load_full_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor] | None,
    *,
    broadcast_from_rank0: bool = True,
    strict: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """Load an unsharded state dict into a sharded ``model``.

    With ``broadcast_from_rank0`` only rank 0 needs the tensors (others may pass ``None``
    or ``{}``). Collective: a bad state dict fails on every rank before the broadcast.

    Args:
        model: the sharded model.
        state_dict: full tensors by name (rank 0 only, with ``broadcast_from_rank0``).
        broadcast_from_rank0: read from rank 0 and broadcast.
        strict: refuse missing or unexpected keys.
        timeout: the arrival check's timeout.

    Raises:
        ValueError: the state dict is missing on rank 0 or malformed (on every rank), or
            ``broadcast_from_rank0`` for a model sharded over part of the world (a
            pipeline stage: torch broadcasts over the whole world).
    """
    ranks = (
        whole_world_ranks(
            model,
            "load_full_state_dict(broadcast_from_rank0=True)",
            "load with broadcast_from_rank0=False (the full state dict, or this stage's "
            "part, on each rank) or with load_pretrained",
        )
        if broadcast_from_rank0
        else group_ranks(model=model)
    )
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=strict
    )
    with enter_collective("load_full_state_dict", ranks=ranks, timeout=timeout) as call:
        call.run(
            lambda: _check_state_dict(state_dict, needed=call.is_main or not broadcast_from_rank0),
            step="checking the state dict",
        )
        set_model_state_dict(model, dict(state_dict or {}), options=options)
        # No state dict holds non-persistent buffers: after to_empty() they are undefined.
        call.run(lambda: refill_unset_buffers(model), step="recomputing buffers")


def _check_state_dict(state_dict: Mapping[str, torch.Tensor] | None, *, needed: bool) -> None:
    if state_dict is None:
        if needed:
            raise ValueError(
                "state_dict is None on the rank that provides the tensors (rank 0 with "
                "broadcast_from_rank0, else every rank); pass the full state dict there"
            )
        return
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict)}")
    wrong = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if wrong:
        raise TypeError(f"state_dict values must be tensors; not for {sorted(wrong)[:8]}")
