"""Each start of the default group gets a store prefix no earlier start used, the same
on every rank, even when the store still holds a dead attempt's keys (a torchrun
restart reuses the store). The handshake of ``init_distributed``, on threads sharing
one in-memory store."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from fsdp_core.distributed import _fresh_group_prefix

TIMEOUT = timedelta(seconds=30)


def _start(store: Any, world_size: int) -> list[str]:
    with ThreadPoolExecutor(world_size) as pool:
        futures = [
            pool.submit(_fresh_group_prefix, store, rank, world_size, TIMEOUT)
            for rank in range(world_size)
        ]
        return [future.result() for future in futures]


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_every_rank_gets_the_same_new_prefix_each_start(world_size: int) -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    starts = [_start(store, world_size) for _ in range(3)]
    for prefixes in starts:
        assert len(set(prefixes)) == 1, prefixes
    assert len({prefixes[0] for prefixes in starts}) == 3


def test_a_dead_attempts_keys_are_not_read() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    first = _start(store, 3)[0]
    # A dead attempt: ranks 1 and 2 wrote their nonces, rank 0 never answered.
    store.set("fsdp_core/join/rank/1", "stale-1")
    store.set("fsdp_core/join/rank/2", "stale-2")
    again = _start(store, 3)
    assert len(set(again)) == 1
    assert again[0] != first


def test_a_rank_that_never_joins_is_a_clear_error() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    store.set("fsdp_core/join/rank/1", "stale")  # from a dead attempt; rank 1 is gone
    with pytest.raises(RuntimeError, match="1 of the 1 other ranks did not join rank 0"):
        _fresh_group_prefix(store, 0, 2, timedelta(seconds=0.3))
    with pytest.raises(RuntimeError, match="rank 1 got no answer from rank 0"):
        _fresh_group_prefix(store, 1, 2, timedelta(seconds=0.3))
