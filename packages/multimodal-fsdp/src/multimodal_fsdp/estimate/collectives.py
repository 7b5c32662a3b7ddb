"""Collective accounting: what one step's collectives are called and what they weigh.

[`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs] predicts collectives from a
plan and
[`multimodal_fsdp.measure.comm`][multimodal_fsdp.measure.comm] counts them on a real step; both
speak
[`CommTally`][multimodal_fsdp.estimate.collectives.CommTally] (defined in
[`fsdp_core.comm_tally`][fsdp_core.comm_tally], where runtime hooks' cost models reach it;
importable from here as before), so a prediction and a measurement compare key
by key. The byte rules live here, in one place: each collective moves the unsharded
buffer, with FSDP's padding of every parameter's dim 0 to a multiple of the
shard-group size, in the dtype on the wire (the compute dtype for all-gathers,
the reduce dtype for reduce-scatters), as [`fsdp_core.CommCounter`][fsdp_core.comm.CommCounter]
counts it. An ``all_to_all`` (the exchange of balanced media) counts the bytes a rank
sends, and the tally keeps what it receives beside them (``received``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core.comm_tally import KINDS, PHASES, CommTally
from fsdp_core.parallel_dims import local_shape
from fsdp_core.precision import compute_dtype

__all__ = [
    "KINDS",
    "PHASES",
    "CommTally",
    "padded_shard_numel",
    "param_compute_dtype",
    "param_reduce_dtype",
    "unit_reduce_dtype",
]


def _dim0_padded_numel(shape: torch.Size, factor: int) -> int:
    """Elements after FSDP pads dim 0 to a multiple of ``factor``; FSDP2 refuses scalar
    (0-d) parameters, so they have none."""
    if not shape:
        raise ValueError(
            "fully_shard does not support scalar parameters; make them 1-D (numel 1) or ignore them"
        )
    rows = math.ceil(shape[0] / factor) * factor
    return rows * math.prod(shape[1:])


def padded_shard_numel(param: nn.Parameter, shard: int) -> int:
    """Elements of one rank's shard after FSDP pads dim 0 to a multiple of ``shard`` (the
    one padding rule of the estimates: collectives, activation replay, memory)."""
    return _dim0_padded_numel(local_shape(param), shard) // shard


def param_compute_dtype(param: nn.Parameter, policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param`` is gathered and computes in: the policy's ``param_dtype`` for a
    floating parameter, else its own (the one dtype rule of the estimates)."""
    if param.dtype.is_floating_point:
        return compute_dtype(policy, param.dtype)
    return param.dtype


def param_reduce_dtype(param: nn.Parameter, policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param``'s gradient is reduced in: ``reduce_dtype``, else its compute dtype."""
    if policy.reduce_dtype is not None:
        return policy.reduce_dtype
    return param_compute_dtype(param, policy)


def unit_reduce_dtype(
    params: list[tuple[str, nn.Parameter]], policy: MixedPrecisionPolicy
) -> torch.dtype:
    """The reduce dtype of a unit: that of its first trainable (else first) parameter."""
    trainable = [p for _, p in params if p.requires_grad] or [p for _, p in params]
    if not trainable:
        return policy.reduce_dtype or policy.param_dtype or torch.float32
    return param_reduce_dtype(trainable[0], policy)


def _gathered_bytes(
    params: list[tuple[str, nn.Parameter]], policy: MixedPrecisionPolicy, shard: int
) -> int:
    """All-gather output bytes: every parameter padded, in its compute dtype."""
    return sum(
        _dim0_padded_numel(local_shape(p), shard) * param_compute_dtype(p, policy).itemsize
        for _, p in params
    )


def _sharded_bytes(params: list[tuple[str, nn.Parameter]], shard: int) -> int:
    """Bytes one rank stores: its padded shard of each parameter, in the storage dtype."""
    return sum(
        _dim0_padded_numel(local_shape(p), shard) // shard * p.dtype.itemsize for _, p in params
    )


def _unit_collectives(
    params: list[tuple[str, nn.Parameter]],
    policy: MixedPrecisionPolicy,
    *,
    gathered: int,
    reshard: bool | int,
    runs_backward: bool,
    shard: int,
    replicate: int,
) -> CommTally:
    """The collectives one unit issues in a step (see
    [`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs])."""
    tally = CommTally()
    if not params:
        return tally
    if shard > 1:
        tally.add("forward", "all_gather", gathered)
        if reshard is not False and runs_backward:
            tally.add("backward", "all_gather", gathered)
    trainable = [p for _, p in params if p.requires_grad]
    if not trainable:
        return tally
    reduce = unit_reduce_dtype(params, policy)
    padded = sum(_dim0_padded_numel(local_shape(p), shard) for p in trainable)
    if shard > 1:
        tally.add("backward", "reduce_scatter", padded * reduce.itemsize)
    if replicate > 1:
        tally.add("backward", "all_reduce", padded // shard * reduce.itemsize)
    return tally
