"""Collective accounting: what one step's collectives are called and what they weigh.

[`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs] predicts collectives from a
plan and
[`multimodal_fsdp.measure.comm`][multimodal_fsdp.measure.comm] counts them on a real step; both
speak
[`CommTally`][multimodal_fsdp.estimate.collectives.CommTally], so a prediction and a measurement
compare key
by key. The byte rules live here too, in one place: each collective moves the unsharded
buffer, with FSDP's padding of every parameter's dim 0 to a multiple of the
shard-group size, in the dtype on the wire (the compute dtype for all-gathers,
the reduce dtype for reduce-scatters), as [`fsdp_core.CommCounter`][fsdp_core.comm.CommCounter]
counts it. An ``all_to_all`` (the exchange of balanced media) counts the bytes a rank
sends, and the tally keeps what it receives beside them (``received``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

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

PHASES: tuple[str, ...] = ("forward", "backward")
KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


@dataclass
class CommTally:
    """Collectives of one step: per (phase, kind), how many and how many bytes (of an
    ``all_to_all``: sent, with the bytes received in ``received``)."""

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[str, str], int] = field(default_factory=dict)
    received: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(
        self, phase: str, kind: str, nbytes: int, count: int = 1, *, received: int | None = None
    ) -> None:
        if count <= 0:
            return
        key = (phase, kind)
        self.counts[key] = self.counts.get(key, 0) + count
        self.nbytes[key] = self.nbytes.get(key, 0) + nbytes
        if received is not None:
            self.received[key] = self.received.get(key, 0) + received

    def merge(self, other: CommTally) -> None:
        for key, count in other.counts.items():
            self.add(
                key[0], key[1], other.nbytes.get(key, 0), count, received=other.received.get(key)
            )

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        """Number of collectives, optionally of one kind and/or phase."""
        return sum(
            n for (p, k), n in self.counts.items() if kind in (None, k) and phase in (None, p)
        )

    def bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes (unsharded buffers), optionally of one kind and/or phase."""
        return sum(
            n for (p, k), n in self.nbytes.items() if kind in (None, k) and phase in (None, p)
        )

    def received_bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes received by the collectives that record them (``all_to_all``),
        optionally of one kind and/or phase."""
        return sum(
            n for (p, k), n in self.received.items() if kind in (None, k) and phase in (None, p)
        )

    def pairs(self) -> list[tuple[str, str]]:
        """(phase, kind) pairs present, phases and kinds in their natural order."""
        order = {name: i for i, name in enumerate((*PHASES, *KINDS))}
        return sorted(self.counts, key=lambda k: (order.get(k[0], 99), order.get(k[1], 99), k))

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {kind: {"count": n, "bytes": b}}}`` (JSON-ready)."""
        result: dict[str, dict[str, dict[str, int]]] = {}
        for phase, kind in self.pairs():
            entry = {
                "count": self.counts[(phase, kind)],
                "bytes": self.nbytes.get((phase, kind), 0),
            }
            if (phase, kind) in self.received:
                entry["received_bytes"] = self.received[(phase, kind)]
            result.setdefault(phase, {})[kind] = entry
        return result

    def differences(self, other: CommTally) -> list[str]:
        """Readable lines where ``self`` (expected) and ``other`` (actual) differ."""
        lines = []
        for key in sorted(set(self.counts) | set(other.counts)):
            mine = (self.counts.get(key, 0), self.nbytes.get(key, 0))
            theirs = (other.counts.get(key, 0), other.nbytes.get(key, 0))
            if mine != theirs:
                lines.append(
                    f"{key[0]} {key[1]}: expected {mine[0]} ({mine[1]} B), "
                    f"got {theirs[0]} ({theirs[1]} B)"
                )
            elif self.received.get(key) != other.received.get(key):
                lines.append(
                    f"{key[0]} {key[1]}: expected {self.received.get(key)} B received, "
                    f"got {other.received.get(key)} B"
                )
        return lines

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CommTally):
            return NotImplemented
        return not self.differences(other)

    __hash__ = None  # type: ignore[assignment]


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
    return _dim0_padded_numel(param.shape, shard) // shard


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
        _dim0_padded_numel(p.shape, shard) * param_compute_dtype(p, policy).itemsize
        for _, p in params
    )


def _sharded_bytes(params: list[tuple[str, nn.Parameter]], shard: int) -> int:
    """Bytes one rank stores: its padded shard of each parameter, in the storage dtype."""
    return sum(_dim0_padded_numel(p.shape, shard) // shard * p.dtype.itemsize for _, p in params)


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
    padded = sum(_dim0_padded_numel(p.shape, shard) for p in trainable)
    if shard > 1:
        tally.add("backward", "reduce_scatter", padded * reduce.itemsize)
    if replicate > 1:
        tally.add("backward", "all_reduce", padded // shard * reduce.itemsize)
    return tally
