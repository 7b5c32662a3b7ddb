"""The collectives of a round of balanced calls and their bytes, predicted from the items.

Plan costs must predict the exchange exactly, so the rule lives beside the exchange and
takes who encodes what from the exchange's own decision (``route_call``); a test
compares it with the bytes really moved. A round is its metadata (``metadata_traffic``)
and then each balanced call's exchange (``call_traffic``); ``exchange_traffic`` is a
round with one balanced call. Sizes are per item, in call order, for every rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass

from multimodal_fsdp.balance._metadata import (
    HEADER_INTS,
    INLINE_INTS,
    ITEM_INTS,
    SLOT_INTS,
    STATUS_INTS,
    payload_ints,
)
from multimodal_fsdp.balance.assign import route_call
from multimodal_fsdp.balance.layouts import CallSpec

__all__ = [
    "ExchangeCollective",
    "exchange_traffic",
    "metadata_traffic",
    "call_traffic",
    "payload_ints",
    "HEADER_INTS",
    "INLINE_INTS",
    "ITEM_INTS",
    "SLOT_INTS",
    "STATUS_INTS",
]


@dataclass(frozen=True)
class ExchangeCollective:
    """One collective of a balanced call as one rank sees it: ``kind`` (``"all_gather"``
    or ``"all_to_all"``), ``phase`` (``"forward"`` or ``"backward"``), the bytes this rank
    puts in (``sent``: its slot of an all_gather, its whole send buffer of an
    all_to_all) and the bytes it gets (``received``)."""

    kind: str
    phase: str
    sent: int
    received: int


def metadata_traffic(payloads: Sequence[int]) -> list[ExchangeCollective]:
    """A round's metadata on any rank: the slot gather, and a gather of every rank's
    table, padded to the longest, when one exceeds ``INLINE_INTS`` words.

    Args:
        payloads: per rank, its item table and blob in words (``payload_ints``; 0 for a
            rank without a call).

    Returns:
        The collectives, in order.
    """
    world = len(payloads)
    result = [ExchangeCollective("all_gather", "forward", SLOT_INTS * 8, world * SLOT_INTS * 8)]
    most = max(payloads, default=0)
    if most > INLINE_INTS:
        result.append(ExchangeCollective("all_gather", "forward", most * 8, world * most * 8))
    return result


def call_traffic(
    costs_by_rank: Sequence[Sequence[int]],
    *,
    rank: int,
    input_bytes: Sequence[Sequence[int]],
    output_bytes: Sequence[Sequence[int]],
    input_grad_bytes: Sequence[Sequence[int]] | None = None,
    output_grad_bytes: Sequence[Sequence[int]] | None = None,
    output_tensors: int | None = None,
    run_when_empty: bool = False,
) -> list[ExchangeCollective]:
    """The collectives ``rank`` runs for one balanced call after the round's metadata.

    Args:
        costs_by_rank: each rank's items' costs, in call order.
        rank: the rank whose collectives are predicted.
        input_bytes: as for ``exchange_traffic``.
        output_bytes: as for ``exchange_traffic``.
        input_grad_bytes: as for ``exchange_traffic``.
        output_grad_bytes: as for ``exchange_traffic``.
        output_tensors: as for ``exchange_traffic``.
        run_when_empty: as for ``exchange_traffic``.

    Returns:
        The collectives, in order: none when no rank has an item or nothing moves and
        no rank must run a placeholder.

    Raises:
        ValueError: ``rank`` is outside the group, a size list does not match the
            costs, or ``output_tensors`` is missing.
    """
    world = len(costs_by_rank)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world} ranks")
    for name, sizes in (
        ("input_bytes", input_bytes),
        ("output_bytes", output_bytes),
        ("input_grad_bytes", input_grad_bytes),
        ("output_grad_bytes", output_grad_bytes),
    ):
        items = [len(costs) for costs in costs_by_rank]
        if sizes is not None and [len(s) for s in sizes] != items:
            raise ValueError(
                f"{name} must give one size per item of every rank: items per rank "
                f"{items}, sizes per rank {[len(s) for s in sizes]}"
            )
    if output_grad_bytes is not None and (
        isinstance(output_tensors, bool)
        or not isinstance(output_tensors, int)
        or output_tensors < 1
    ):
        raise ValueError(
            "output_grad_bytes needs output_tensors=, the number of tensors in the tower's "
            f"output (a positive int; one gradient flag byte each per rank), got {output_tensors!r}"
        )
    route = route_call(costs_by_rank, run_when_empty=run_when_empty)
    if route is None:
        return []

    def mine(sizes: Sequence[Sequence[int]]) -> int:
        return sum(route.per_peer(rank, sizes)[0])

    def theirs(sizes: Sequence[Sequence[int]]) -> int:
        return sum(route.per_peer(rank, sizes)[1])

    result = [
        ExchangeCollective("all_to_all", "forward", mine(input_bytes), theirs(input_bytes)),
        ExchangeCollective("all_gather", "forward", STATUS_INTS * 8, world * STATUS_INTS * 8),
        ExchangeCollective("all_to_all", "forward", theirs(output_bytes), mine(output_bytes)),
    ]
    if output_grad_bytes is not None:
        flags = world * int(output_tensors or 0)
        result.append(
            ExchangeCollective(
                "all_to_all",
                "backward",
                mine(output_grad_bytes) + flags,
                theirs(output_grad_bytes) + flags,
            )
        )
        if input_grad_bytes is not None:
            result.append(
                ExchangeCollective(
                    "all_to_all", "backward", theirs(input_grad_bytes), mine(input_grad_bytes)
                )
            )
    return result


def exchange_traffic(
    costs_by_rank: Sequence[Sequence[int]],
    *,
    rank: int,
    spec: CallSpec | None,
    input_bytes: Sequence[Sequence[int]],
    output_bytes: Sequence[Sequence[int]],
    input_grad_bytes: Sequence[Sequence[int]] | None = None,
    output_grad_bytes: Sequence[Sequence[int]] | None = None,
    output_tensors: int | None = None,
    run_when_empty: bool = False,
    callers: Sequence[int] | None = None,
) -> list[ExchangeCollective]:
    """The collectives ``rank`` runs in one round with one balanced call.

    Args:
        costs_by_rank: each rank's items' costs, in call order.
        rank: the rank whose collectives are predicted.
        spec: the calls' ``CallSpec`` (None when no rank calls: the last round of
            ``join_remaining_calls``, one slot gather).
        input_bytes: per rank and item, the bytes of its fields (rows times row
            elements times item size, summed over the fields).
        output_bytes: per rank and item, the bytes of its output pieces.
        input_grad_bytes: as ``input_bytes`` for the floating inputs that require grad
            (None: none does).
        output_grad_bytes: as ``output_bytes`` for the floating outputs (None: no
            gradient flows back, e.g. a frozen tower under inputs that need none).
        output_tensors: the tensors in the tower's output, floating or not, required
            with ``output_grad_bytes`` (one has-gradient byte each to every rank).
        run_when_empty: the tower owns FSDP units (a rank without items runs a
            placeholder, which needs the exchange).
        callers: the ranks that call, whose item tables and specs travel in the
            metadata (default: those with items; every rank when none has one).

    Returns:
        The collectives, in order.
    """
    traffic = call_traffic(  # checks the arguments, also for a round without a call
        costs_by_rank,
        rank=rank,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        input_grad_bytes=input_grad_bytes,
        output_grad_bytes=output_grad_bytes,
        output_tensors=output_tensors,
        run_when_empty=run_when_empty,
    )
    world = len(costs_by_rank)
    if spec is None:  # no rank calls: the round ends after the slots
        return metadata_traffic([0] * world)
    blob = len(pickle.dumps(spec))
    if callers is None:
        with_items = [r for r in range(world) if costs_by_rank[r]]
        callers = with_items or list(range(world))
    payloads = [
        payload_ints(len(costs_by_rank[r]), blob) if r in callers else 0 for r in range(world)
    ]
    return [*metadata_traffic(payloads), *traffic]
