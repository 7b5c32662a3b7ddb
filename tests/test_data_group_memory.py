"""The memory model of a data group's gather after a split balanced call, held to the
gather itself.

Under the fake process group (2 ranks, this one at position 0 of the data group), the
same live-bytes tracker the activation trace uses follows ``gather_outputs`` (the
runtime's gather: header, send buffer, the share flattened, one receive buffer per rank,
the other shares' items copied out, the whole output joined) and the trace's stand-in
for it (``estimate._data_group_trace``: the share's output in, the whole call's out, the
buffers bumped); the peak and what stays after are the same, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_core.fake_group import fake_process_group
from multimodal_fsdp.balance._data_group import DataGroup, gather_outputs, share_of_position
from multimodal_fsdp.balance.generic_layouts import BatchFirstLayout
from multimodal_fsdp.estimate._data_group_trace import _Share
from multimodal_fsdp.estimate.activations import _LiveBytes


def _tower(weights: list[int]) -> dict[str, torch.Tensor]:
    """A call's output: 1 row of 3 floats per weight, 2 rows of 2 halves per weight."""
    rows = sum(weights)
    return {"a": torch.rand(rows, 3), "b": torch.rand(2 * rows, 2).half()}


def _traced(run: Callable[[_LiveBytes], Any]) -> tuple[int, int]:
    """Peak and final live bytes of ``run`` (given the tracker; its result kept)."""
    live = _LiveBytes(set())
    with live:
        kept = run(live)
    assert kept is not None
    return live.peak, live.live


@pytest.mark.parametrize("weights", [[2, 1, 3], [4, 4, 4, 4], [1, 5]])
@pytest.mark.parametrize("size", [2, 4])
def test_the_traced_gather_allocates_what_the_gather_does(weights: list[int], size: int) -> None:
    """Split calls (as many items as ranks or more) and unsplit ones (every rank keeps
    its whole call's output, nothing gathered)."""
    layout = BatchFirstLayout()
    start, stop = share_of_position(len(weights), 0, size)
    with fake_process_group(size):
        data = DataGroup(group=dist.group.WORLD, ranks=tuple(range(size)), position=0)

        def gathered(_live: _LiveBytes) -> Any:
            mine = _tower(weights[start:stop])
            return gather_outputs(layout, data, mine, weights, torch.device("cpu"))

        def stand_in(live: _LiveBytes) -> Any:
            share = _Share(layout, live, size)
            share.weights.append(list(weights))
            mine = _tower(weights[start:stop])
            whole = share.post(torch.nn.Identity(), (), {}, mine)
            return mine if whole is None else whole

        measured = _traced(gathered)
        predicted = _traced(stand_in)
    assert predicted == measured


@pytest.mark.parametrize(
    ("weights", "needs"),
    [
        ([2, 1, 3], (0, 2)),
        ([2, 1, 3], None),
        ([4, 4, 4, 4], (0, 1)),
        ([4, 4, 4, 4], (0, 3)),
        ([1, 5, 2], (0, 2)),
        ([1, 5], (0,)),
    ],
)
@pytest.mark.parametrize("size", [2, 4])
def test_the_traced_cp_exchange_allocates_what_the_exchange_does(
    weights: list[int], needs: tuple[int, ...] | None, size: int
) -> None:
    """A CP data group (``indexed``): the header with every rank's item mask, then the
    all_to_all of the needed items another rank encoded (or the all_gather when every
    rank needs every item), and this rank's needed items out. Under the fake group every
    rank's mask is this rank's, so the stand-in is given that mask for every position;
    each mask holds an item of this rank's share (the fake backend refuses an all_to_all
    that sends nothing while it receives)."""
    layout = BatchFirstLayout()
    start, stop = share_of_position(len(weights), 0, size)
    wanted = tuple(range(len(weights))) if needs is None else needs
    with fake_process_group(size):
        data = DataGroup(group=dist.group.WORLD, ranks=tuple(range(size)), position=0, indexed=True)

        def exchanged(_live: _LiveBytes) -> Any:
            mine = _tower(weights[start:stop])
            return mine, gather_outputs(layout, data, mine, weights, torch.device("cpu"), needs)

        def stand_in(live: _LiveBytes) -> Any:
            share = _Share(layout, live, size, indexed=True)
            share.weights.append(list(weights))
            share.needs.append([wanted] * size)
            mine = _tower(weights[start:stop])
            return mine, share.post(torch.nn.Identity(), (), {}, mine)

        measured = _traced(exchanged)
        predicted = _traced(stand_in)
    assert predicted == measured
