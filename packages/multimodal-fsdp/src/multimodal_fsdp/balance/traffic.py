"""The collectives of a round of balanced calls and their bytes, predicted from the items.

Plan costs must predict the exchange exactly, so the rule lives beside the exchange, takes
who encodes what from the exchange's own decision (``route_call``), and a test compares it
with the bytes the exchange really moves. Sizes are per item, in call order, for every
rank: what its fields weigh (``input_bytes``: rows times row elements times item size,
summed over the fields) and what its output pieces weigh (``output_bytes``, summed over
the output tensors). In backward the output gradients carry one has-gradient byte per
output tensor to every rank (``output_tensors``), so an output no loss reads gets no
gradient anywhere.

A round is its metadata (``metadata_traffic``: one slot gather, and one more when some
rank's item table and blob do not fit inline) and then, per balanced module called in
it, that call's exchange (``call_traffic``: nothing when every item stays home, else
the inputs, the status and the outputs, and the gradients in backward).
``exchange_traffic`` is a round with one balanced call.
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


def _check(name: str, sizes: Sequence[Sequence[int]], costs: Sequence[Sequence[int]]) -> None:
    if [len(s) for s in sizes] != [len(c) for c in costs]:
        raise ValueError(
            f"{name} must give one size per item of every rank: items per rank "
            f"{[len(c) for c in costs]}, sizes per rank {[len(s) for s in sizes]}"
        )


def metadata_traffic(payloads: Sequence[int]) -> list[ExchangeCollective]:
    """A round's metadata on any rank, from each rank's payload in words (item table and
    blob, ``payload_ints``; 0 for a rank without a call): the slot gather, and a gather
    of every rank's table, padded to the longest, when one exceeds ``INLINE_INTS``."""
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
    """The collectives ``rank`` runs for one balanced call after the round's metadata
    (see ``exchange_traffic`` for the arguments): none when no rank has an item or every
    item stays on its rank (and, for a module with units, every rank encodes one)."""
    world = len(costs_by_rank)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world} ranks")
    for name, sizes in (
        ("input_bytes", input_bytes),
        ("output_bytes", output_bytes),
        ("input_grad_bytes", input_grad_bytes),
        ("output_grad_bytes", output_grad_bytes),
    ):
        if sizes is not None:
            _check(name, sizes, costs_by_rank)
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
    """The collectives ``rank`` runs in one round with one balanced call, in order.

    ``spec`` is the calls' ``CallSpec`` (``None`` when no rank calls the tower: the
    last round of ``join_remaining_calls``, one slot gather).
    ``output_grad_bytes`` is ``None`` when no gradient flows back (grad mode off, or a
    frozen tower with inputs that need none), else the floating output bytes per item;
    ``input_grad_bytes`` likewise for the inputs (``None`` unless some rank's floating
    input requires grad). ``output_tensors``, required with ``output_grad_bytes``: how
    many tensors the tower's output holds (all of them, floating or not); the gradient
    all_to_all sends that many flag bytes to every rank, itself included.
    ``run_when_empty``: the tower owns FSDP units (a rank that would encode nothing runs
    a placeholder, which needs the exchange). ``callers``: the ranks that call (default:
    those with items; every rank when none has one), whose item tables and specs travel
    in the metadata.
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
