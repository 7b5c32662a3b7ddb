"""The traced step of a rank whose data group (TP ranks holding the same batch) shares the
encoding (``multimodal_fsdp.balance._data_group``): the tower runs on the share of the
rank at position 0 (the rank the estimates predict), and the whole call's output is
rebuilt as ``gather_outputs`` does, with the gather's buffers bumped while they live.

With CP ranks in the group (``indexed``) a header with every rank's item mask precedes an
``all_to_all`` of the items each rank needs. The trace runs one CP rank's tokens as one
sequence holding every media token, so it needs every item: its exchange is the
``all_gather`` after the larger header, an upper bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from multimodal_fsdp.balance import media_layout_for
from multimodal_fsdp.balance._data_group import HEADER_INTS, share_of_position, splits
from multimodal_fsdp.balance._planned import BalancedTower, Removable
from multimodal_fsdp.balance.context_parallel import split_frames
from multimodal_fsdp.balance.layouts import MediaLayout, OutputSpec


class _Live(Protocol):
    def bump(self, nbytes: int, *, gathered: bool = False) -> None: ...


def _all_to_all_buffer_bytes(
    item_bytes: Sequence[int], needs: Sequence[Sequence[int]], shares: Sequence[tuple[int, int]]
) -> tuple[int, int]:
    """The all_to_all's buffers of a CP data group's rank at position 0 after a split call
    whose items' outputs take ``item_bytes``, when the position ``p`` needs the items
    ``needs[p]`` and encoded ``shares[p]``: during it the items of its share each other
    rank needs, flattened per rank and joined, and the receive buffer of the items it
    needs from the others; after it, until its needed output is joined, that buffer."""
    start, stop = shares[0]
    sent = sum(item_bytes[i] for wanted in needs[1:] for i in wanted if start <= i < stop)
    received = sum(item_bytes[i] for i in needs[0] if not start <= i < stop)
    return 2 * sent + received, received


def _item_bytes(spec: OutputSpec, weight: int) -> list[int]:
    return [
        spec.rows(leaf, weight) * int(torch.Size(shape).numel()) * spec.dtypes[leaf].itemsize
        for leaf, shape in enumerate(spec.row_shapes)
    ]


def _others(spec: OutputSpec, weight: int) -> tuple[torch.Tensor, ...]:
    """An item of another share, as the gather rebuilds it (its rows, new storage)."""
    return tuple(
        torch.empty(spec.rows(leaf, weight), *shape, dtype=spec.dtypes[leaf])
        for leaf, shape in enumerate(spec.row_shapes)
    )


class _Share:
    """One balanced tower's calls in the trace: its share in, the output out (the whole
    call's; on a CP data group, ``indexed``, the items position 0 needs)."""

    def __init__(
        self, layout: MediaLayout, live: _Live, size: int, *, indexed: bool = False
    ) -> None:
        self.layout, self.live, self.size, self.indexed = layout, live, size, indexed
        self.weights: list[list[int]] = []  # per call in flight: the whole call's weights
        #: per call in flight (``indexed``): the items each position of the group needs
        self.needs: list[list[Sequence[int]]] = []

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        call = split_frames(self.layout, self.layout.split_call(module, tuple(args), kwargs))
        weights = [int(item.fields[0].shape[0]) for item in call.items]
        self.weights.append(weights)
        if self.indexed:  # the traced tokens hold every item's media tokens: all needed
            self.needs.append([range(len(weights))] * self.size)
        if not splits(len(call.items), self.size):
            return None  # every rank of the group encodes the whole call
        start, stop = share_of_position(len(call.items), 0, self.size)
        return self.layout.build_call(call.spec, call.items[start:stop])

    def post(self, _module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
        weights = self.weights.pop()
        needs = self.needs.pop() if self.indexed else [range(len(weights))] * self.size
        split = splits(len(weights), self.size)
        if not split and not self.indexed:
            return None
        shares = [share_of_position(len(weights), p, self.size) for p in range(self.size)]
        start, stop = shares[0]
        spec, mine = self.layout.split_output(output, weights[start:stop])
        if self.indexed:  # the header: bytes, fingerprint, bad-index flag, item mask
            header = (HEADER_INTS + 1 + len(weights)) * 8 * (1 + self.size)
            self.live.bump(header)
            self.live.bump(-header)
        if not split:
            return self.layout.join_output(spec, [mine[i] for i in needs[0]])
        item_bytes = [sum(_item_bytes(spec, w)) for w in weights]
        if all(len(n) == len(weights) for n in needs):
            # during the all_gather: its send buffer, the share's bytes flattened into it
            # and a receive buffer per rank; after it, until the output is joined, those
            totals = [sum(item_bytes[slice(*share)]) for share in shares]
            after = self.size * max(totals)
            during = max(totals) + totals[0] + after
        else:
            during, after = _all_to_all_buffer_bytes(item_bytes, needs, shares)
        self.live.bump(during)
        self.live.bump(after - during)
        pieces: Sequence[Sequence[torch.Tensor]] = [
            mine[i] if i < stop else _others(spec, weights[i]) for i in needs[0]
        ]
        whole = self.layout.join_output(spec, pieces)
        self.live.bump(-after)
        return whole


def trace_shares(
    twin: nn.Module,
    towers: Sequence[BalancedTower],
    live: _Live,
    size: int,
    *,
    indexed: bool = False,
) -> list[Removable]:
    """Hooks on ``twin``'s balanced ``towers`` that trace a data group of ``size`` ranks
    sharing the encoding (see the module docstring), with CP ranks among them when
    ``indexed``; remove them after the step."""
    handles: list[Removable] = []
    for tower in towers:
        module = twin.get_submodule(tower.path)
        share = _Share(media_layout_for(module, name=tower.layout), live, size, indexed=indexed)
        pre: Callable[..., Any] = share.pre
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(share.post, with_kwargs=True, prepend=True))
    return handles
