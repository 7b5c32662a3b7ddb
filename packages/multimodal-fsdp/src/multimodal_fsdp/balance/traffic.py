"""The collectives of one balanced call and their bytes, predicted from the item sizes.

Plan costs must predict the exchange exactly, so the rule lives beside the exchange and
a test compares it with the bytes the exchange really moves. Sizes are per item, in
call order, for every rank: what its fields weigh (``input_bytes``: rows times row
elements times item size, summed over the fields) and what its output pieces weigh
(``output_bytes``, summed over the output tensors). In backward the output gradients
carry one has-gradient byte per output tensor to every rank (``output_tensors``), so an
output no loss reads gets no gradient anywhere.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

from multimodal_fsdp.balance._metadata import HEADER_INTS, ITEM_INTS, STATUS_INTS
from multimodal_fsdp.balance.assign import assign_items
from multimodal_fsdp.balance.layouts import CallSpec

__all__ = [
    "ExchangeCollective",
    "exchange_traffic",
    "HEADER_INTS",
    "ITEM_INTS",
    "STATUS_INTS",
]


@dataclass(frozen=True)
class ExchangeCollective:
    """One collective of a balanced call as one rank sees it: ``kind`` (``"all_gather"``
    or ``"all_to_all"``), ``phase`` (``"forward"`` or ``"backward"``), the bytes this rank
    puts in (``sent``: its slot of an all_gather, its whole send buffer of an
    all_to_all, the part for itself included) and the bytes it gets (``received``)."""

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
) -> list[ExchangeCollective]:
    """The collectives ``rank`` runs in one balanced call, in order.

    ``spec`` is the calls' ``CallSpec`` (``None`` when no rank calls the tower: the
    last round of ``join_remaining_calls``, one header gather).
    ``output_grad_bytes`` is ``None`` when no gradient flows back (grad mode off, or a
    frozen tower with inputs that need none), else the floating output bytes per item;
    ``input_grad_bytes`` likewise for the inputs (``None`` unless some rank's floating
    input requires grad). ``output_tensors``, required with ``output_grad_bytes``: how
    many tensors the tower's output holds (all of them, floating or not); the gradient
    all_to_all sends that many flag bytes to every rank, itself included.
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
    most = max(len(costs) for costs in costs_by_rank)
    blob = len(pickle.dumps(spec)) if spec is not None else 0
    table_ints = most * ITEM_INTS + math.ceil(blob / 8)
    result = [ExchangeCollective("all_gather", "forward", HEADER_INTS * 8, world * HEADER_INTS * 8)]
    if spec is None:  # no rank calls: the round ends after the headers
        return result
    result.append(
        ExchangeCollective("all_gather", "forward", table_ints * 8, world * table_ints * 8)
    )
    if not any(costs_by_rank):
        return result
    owners = assign_items(costs_by_rank)
    encoded = [
        (r, i) for r in range(world) for i in range(len(costs_by_rank[r])) if owners[r][i] == rank
    ]

    def mine(sizes: Sequence[Sequence[int]]) -> int:
        return sum(sizes[rank])

    def theirs(sizes: Sequence[Sequence[int]]) -> int:
        return sum(sizes[r][i] for r, i in encoded)

    result += [
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
