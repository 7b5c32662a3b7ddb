"""The deterministic rule that gives each rank its share of a tower call's items.

Every rank computes the assignment itself from the gathered item costs, so the rule
must give the same answer everywhere: it uses integers only and breaks every tie by
rank and position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CallRoute", "assign_items", "route_call"]


def assign_items(costs_by_rank: Sequence[Sequence[int]]) -> list[list[int]]:
    """The encoding rank of each item: ``owners[r][i]`` for item ``i`` of rank ``r``.

    Longest processing time first: items by falling cost (ties by position, then owner)
    go to the least-loaded rank, preferring the owner, then the lowest rank; every rank
    gets an item when there are enough, and the most-loaded is within 4/3 of the best.
    A second pass sends items home wherever that raises no rank above the most-loaded
    one (fewer bytes, the same step time), keeping every rank non-empty.

    Args:
        costs_by_rank: each rank's items' costs (positive integers), in call order.

    Returns:
        ``owners``, shaped like ``costs_by_rank``.

    Raises:
        ValueError: no rank is given, or a cost is not a positive integer.
    """
    world = len(costs_by_rank)
    if world < 1:
        raise ValueError("assign_items needs the costs of at least one rank")
    for rank, costs in enumerate(costs_by_rank):
        for index, cost in enumerate(costs):
            if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
                raise ValueError(
                    f"item costs must be positive integers; rank {rank} item {index} costs {cost!r}"
                )
    order = sorted(
        (
            (cost, index, rank)
            for rank, costs in enumerate(costs_by_rank)
            for index, cost in enumerate(costs)
        ),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    loads = [0] * world
    counts = [0] * world
    owners = [[-1] * len(costs) for costs in costs_by_rank]
    for cost, index, owner in order:
        least = min(loads)
        target = owner if loads[owner] == least else loads.index(least)
        owners[owner][index] = target
        loads[target] += cost
        counts[target] += 1
    # Second pass: send items home where that costs no step time.
    peak = max(loads)
    for cost, index, owner in order:
        target = owners[owner][index]
        if target == owner or counts[target] == 1 or loads[owner] + cost > peak:
            continue
        owners[owner][index] = owner
        loads[target] -= cost
        loads[owner] += cost
        counts[target] -= 1
        counts[owner] += 1
    return owners


@dataclass(frozen=True)
class CallRoute:
    """Where one balanced call's items are encoded (``owners``, as ``assign_items``
    returns it): the one decision the exchange runs and the cost model counts."""

    owners: tuple[tuple[int, ...], ...]

    def kept(self, rank: int) -> list[int]:
        """``rank``'s items it encodes itself, in call order.

        Args:
            rank: a rank of the balance group.

        Returns:
            The positions of those items.
        """
        return [i for i, target in enumerate(self.owners[rank]) if target == rank]

    def away(self, rank: int) -> list[int]:
        """``rank``'s items encoded elsewhere, by encoding rank then position: the order
        their inputs leave and their outputs come back in.

        Args:
            rank: a rank of the balance group.

        Returns:
            The positions of those items.
        """
        mine = self.owners[rank]
        return sorted((i for i, t in enumerate(mine) if t != rank), key=lambda i: (mine[i], i))

    def assigned(self, rank: int) -> list[tuple[int, int]]:
        """Other ranks' items ``rank`` encodes, ``(owner, position)`` by owner then
        position: the order their inputs arrive and their outputs leave in.

        Args:
            rank: a rank of the balance group.

        Returns:
            ``(owner, position)`` per item.
        """
        return [
            (owner, i)
            for owner, targets in enumerate(self.owners)
            if owner != rank
            for i, target in enumerate(targets)
            if target == rank
        ]

    def per_peer(
        self, rank: int, sizes: Sequence[Sequence[int]]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What ``rank``'s items encoded elsewhere weigh per encoding rank, and what the
        items it encodes for others weigh per owner: the inputs' send and receive splits
        (the outputs' in reverse).

        Args:
            rank: a rank of the balance group.
            sizes: ``sizes[owner][position]`` of every item.

        Returns:
            ``(send splits, receive splits)``, one entry per rank.
        """
        world = len(self.owners)
        out, back = [0] * world, [0] * world
        for i in self.away(rank):
            out[self.owners[rank][i]] += sizes[rank][i]
        for owner, i in self.assigned(rank):
            back[owner] += sizes[owner][i]
        return tuple(out), tuple(back)


def route_call(costs_by_rank: Sequence[Sequence[int]], *, run_when_empty: bool) -> CallRoute | None:
    """The route of one balanced call, or ``None`` when it exchanges nothing (every
    caller runs its own call): no rank has an item, or none moves and no rank must run
    a placeholder (``run_when_empty`` where some rank would encode nothing).

    Args:
        costs_by_rank: each rank's items' costs (positive integers), in call order.
        run_when_empty: whether the module owns FSDP units.

    Returns:
        The route, or ``None``.
    """
    if not any(costs_by_rank):
        return None
    owners = assign_items(costs_by_rank)
    moved = any(t != rank for rank, targets in enumerate(owners) for t in targets)
    encoding = {t for targets in owners for t in targets}
    if not moved and not (run_when_empty and len(encoding) < len(owners)):
        return None
    return CallRoute(owners=tuple(tuple(targets) for targets in owners))
