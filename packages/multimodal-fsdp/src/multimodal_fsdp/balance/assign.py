"""The deterministic rule that gives each rank its share of a tower call's items.

Every rank computes the assignment itself from the gathered item costs, so the rule
must give the same answer everywhere: it uses integers only and breaks every tie by
rank and position.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_items", "needs_exchange"]


def assign_items(costs_by_rank: Sequence[Sequence[int]]) -> list[list[int]]:
    """The encoding rank of each item: ``owners[r][i]`` for item ``i`` of rank ``r``.

    Longest processing time first: items by falling cost (then by position, then by
    owner, so equal items alternate between owners) go to the least-loaded rank,
    preferring the item's owner, then the lowest rank. With positive costs this gives
    every rank at least one item when there are at least as many items as ranks, and a
    most-loaded rank within 4/3 of the best possible. A second pass moves an item back
    to its owner wherever that raises no rank above the most-loaded one (fewer bytes
    exchanged, the same step time), keeping every rank non-empty.

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


def needs_exchange(owners: Sequence[Sequence[int]], run_when_empty: bool) -> bool:
    """Whether a balanced call with this assignment exchanges anything: some item is
    encoded away from its owner, or the module owns FSDP units (``run_when_empty``) and
    some rank encodes nothing (it runs a placeholder, which the exchange links to the
    others' gradients). Otherwise every caller runs its own call, as without balancing.

    Args:
        owners: what ``assign_items`` returned.
        run_when_empty: whether the module owns FSDP units.

    Returns:
        Whether the call exchanges.
    """
    encoding = [False] * len(owners)
    for rank, targets in enumerate(owners):
        for target in targets:
            encoding[target] = True
            if target != rank:
                return True
    return run_when_empty and not all(encoding)
