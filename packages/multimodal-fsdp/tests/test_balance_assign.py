"""assign_items: the same answer on every rank, balanced load, every rank busy, items
kept at home where that costs nothing."""

from __future__ import annotations

import itertools
import random

import pytest

from multimodal_fsdp.balance import assign_items


def _loads(costs: list[list[int]], owners: list[list[int]]) -> list[int]:
    loads = [0] * len(costs)
    for rank, items in enumerate(costs):
        for index, cost in enumerate(items):
            loads[owners[rank][index]] += cost
    return loads


def _max_over_mean(costs: list[list[int]], owners: list[list[int]]) -> float:
    loads = _loads(costs, owners)
    return max(loads) / (sum(loads) / len(loads))


def test_all_items_on_one_rank_spread_evenly() -> None:
    costs = [[100] * 8, [], [], []]
    owners = assign_items(costs)
    assert _loads(costs, owners) == [200, 200, 200, 200]


def test_three_to_one_skew_of_mixed_sizes() -> None:
    rng = random.Random(0)
    costs = [
        [rng.choice([64, 256, 1024]) for _ in range(12)],
        [rng.choice([64, 256, 1024]) for _ in range(4)],
    ]
    owners = assign_items(costs)
    assert _max_over_mean(costs, owners) <= 1.15
    before = [sum(c) for c in costs]
    assert max(before) / (sum(before) / 2) > 1.3  # the input really was skewed


def test_video_heavy_skew_on_four_ranks() -> None:
    costs = [[4096, 1024, 1024, 256], [256, 256], [], [1024]]
    owners = assign_items(costs)
    loads = _loads(costs, owners)
    assert max(loads) == 4096  # the one video alone cannot be split: the best possible
    assert all(load > 0 for load in loads)


def test_even_distribution_moves_nothing() -> None:
    costs = [[256, 64, 64], [256, 64, 64], [256, 64, 64]]
    assert assign_items(costs) == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]


def test_every_rank_gets_an_item_when_there_are_enough() -> None:
    for costs in ([[5, 1, 1, 1], [], []], [[1, 1, 1], [1000]], [[1] * 4, [], [], []]):
        owners = assign_items(costs)
        used = {o for row in owners for o in row}
        assert used == set(range(len(costs)))


def test_a_rank_with_items_always_encodes_one_of_fewer_items_than_ranks() -> None:
    """The exchange relies on it: such a rank learns the output structure from its own run."""
    for costs in itertools.product([[], [3], [3, 1], [10, 1]], repeat=3):
        owners = assign_items([list(c) for c in costs])
        for rank, items in enumerate(costs):
            if items:
                assert rank in {o for row in owners for o in row}


def test_deterministic_and_independent_of_list_identity() -> None:
    rng = random.Random(1)
    costs = [[rng.randint(1, 500) for _ in range(rng.randint(0, 9))] for _ in range(4)]
    assert assign_items(costs) == assign_items([list(c) for c in costs])


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_costs_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(ValueError, match=f"rank 1 item 0 costs {bad!r}"):
        assign_items([[1], [bad]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one rank"):
        assign_items([])
