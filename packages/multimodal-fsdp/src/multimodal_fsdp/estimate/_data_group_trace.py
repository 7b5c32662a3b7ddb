"""The traced step of a rank whose data group (TP ranks holding the same batch) shares
the encoding: the rank encodes its share of each split call and the group gathers the
shares' outputs (``multimodal_fsdp.balance._data_group``).

The trace calls the tower on the share the rank at position 0 brings (the rank the
estimates predict), then rebuilds the whole call's output as ``gather_outputs`` does:
the other shares' items as new tensors (there, copies out of the receive buffer) joined
with its own, and bumps the gather's buffers no traced tensor holds while they live.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from multimodal_fsdp.balance import media_layout_for
from multimodal_fsdp.balance._data_group import share_of_position, splits
from multimodal_fsdp.balance._planned import BalancedTower, Removable
from multimodal_fsdp.balance.context_parallel import split_frames
from multimodal_fsdp.balance.layouts import MediaLayout, OutputSpec

__all__ = ["gather_buffer_bytes", "trace_shares"]


class _Live(Protocol):
    def bump(self, nbytes: int, *, gathered: bool = False) -> None: ...


def gather_buffer_bytes(own: int, longest: int, size: int) -> tuple[int, int]:
    """The gather's buffers beside the share's output (``own`` bytes) on a data group of
    ``size`` ranks whose longest share's outputs take ``longest`` bytes: during the
    ``all_gather`` its send buffer, the share's bytes flattened into it and the receive
    buffers (one per rank); after it, until the whole output is joined, the receive
    buffers alone."""
    return longest + own + size * longest, size * longest


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
    """One balanced tower's calls in the trace: its share in, the whole output out."""

    def __init__(self, layout: MediaLayout, live: _Live, size: int) -> None:
        self.layout, self.live, self.size = layout, live, size
        self.weights: list[list[int]] = []  # per call in flight: the whole call's weights

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        call = split_frames(self.layout, self.layout.split_call(module, tuple(args), kwargs))
        weights = [int(item.fields[0].shape[0]) for item in call.items]
        self.weights.append(weights)
        if not splits(len(call.items), self.size):
            return None  # every rank of the group encodes the whole call
        start, stop = share_of_position(len(call.items), 0, self.size)
        return self.layout.build_call(call.spec, call.items[start:stop])

    def post(self, _module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
        weights = self.weights.pop()
        if not splits(len(weights), self.size):
            return None
        shares = [share_of_position(len(weights), p, self.size) for p in range(self.size)]
        start, stop = shares[0]
        spec, mine = self.layout.split_output(output, weights[start:stop])
        totals = [
            sum(sum(_item_bytes(spec, w)) for w in weights[slice(*share)]) for share in shares
        ]
        during, after = gather_buffer_bytes(totals[0], max(totals), self.size)
        self.live.bump(during)
        self.live.bump(after - during)
        pieces: Sequence[Sequence[torch.Tensor]] = [
            *mine,
            *(_others(spec, w) for w in weights[stop:]),
        ]
        whole = self.layout.join_output(spec, pieces)
        self.live.bump(-after)
        return whole


def trace_shares(
    twin: nn.Module, towers: Sequence[BalancedTower], live: _Live, size: int
) -> list[Removable]:
    """Hooks on ``twin``'s balanced ``towers`` that trace a data group of ``size`` ranks
    sharing the encoding (see the module docstring); remove them after the step."""
    handles: list[Removable] = []
    for tower in towers:
        module = twin.get_submodule(tower.path) if tower.path else twin
        share = _Share(media_layout_for(module, name=tower.layout), live, size)
        pre: Callable[..., Any] = share.pre
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(share.post, with_kwargs=True, prepend=True))
    return handles
