"""Context parallelism: each CP rank gets the media features of its own sequence shard.

The ranks of a CP group hold different tokens of the same samples and the same media;
with ``balance_media=True`` and frozen towers they form part of a *data group*
(``multimodal_fsdp.balance._data_group``) and each encodes a share of every call's
items. Inside
[`context_parallel_media`][multimodal_fsdp.balance.context_parallel.context_parallel_media]
a rank names, per balanced call, the items its shard's media tokens need, and gets only
those items' outputs (from the ranks that encoded them), so no rank holds the features
of a whole sample;
[`items_of_tokens`][multimodal_fsdp.balance.context_parallel.items_of_tokens] turns a
shard's media token ordinals into those items. A video that is one ``packed-by-grid``
item (``(t, h, w)``) is cut into ``t`` one-frame items with ``frames=True`` (its tower
attends within a frame); a ``batch-first`` video is already one item per frame.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from multimodal_fsdp.balance._data_group import select_items
from multimodal_fsdp.balance.generic_layouts import PackedByGridLayout
from multimodal_fsdp.balance.layouts import MediaCall, MediaItem, MediaLayout

__all__ = ["context_parallel_media", "items_of_tokens"]


@dataclass
class _Needs:
    """The items named per call, and how many calls have taken theirs."""

    calls: tuple[tuple[int, ...], ...]
    frames: bool = False
    taken: int = field(default=0)


_NEEDS: ContextVar[_Needs | None] = ContextVar("multimodal_fsdp_cp_needs", default=None)


@contextmanager
def context_parallel_media(*calls: Sequence[int], frames: bool = False) -> Iterator[None]:
    """Inside, this rank's ``k``-th balanced tower call returns the outputs of the items
    ``calls[k]`` only (later calls: every item). For CP ranks whose towers are balanced
    on data groups; a wrong index raises a ``ValueError`` on every rank of the group.

    Args:
        calls: per balanced tower call in the forward(s) inside, the items this rank's
            sequence shard needs (e.g. ``items_of_tokens(...)[0]``).
        frames: cut each ``(t, h, w)`` item of a ``packed-by-grid`` call into ``t``
            one-frame items first (the items ``calls`` names are then frames); every rank
            of a CP group must pass the same value.

    Raises:
        TypeError: an entry is not a sequence of ints, or ``frames`` not a bool.
    """
    if not isinstance(frames, bool):
        raise TypeError(f"frames must be a bool, got {frames!r}")
    checked = []
    for items in calls:
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(f"each call's items must be a sequence of ints, got {items!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise TypeError(f"each call's items must be ints, got {list(items)!r}")
        checked.append(tuple(items))
    token = _NEEDS.set(_Needs(tuple(checked), frames=frames))
    try:
        yield
    finally:
        _NEEDS.reset(token)


def take_needs() -> tuple[int, ...] | None:
    """The items this rank's next balanced call needs (``None``: every item)."""
    needs = _NEEDS.get()
    if needs is None or needs.taken >= len(needs.calls):
        return None
    needs.taken += 1
    return needs.calls[needs.taken - 1]


def split_frames(layout: MediaLayout, call: MediaCall) -> MediaCall:
    """``call`` with each ``(t, h, w)`` item of a ``packed-by-grid`` call cut into ``t``
    one-frame items inside ``context_parallel_media(..., frames=True)``: per-patch
    fields are cut, the grid row becomes ``(1, h, w)``, other fields go with every frame."""
    needs = _NEEDS.get()
    if needs is None or not needs.frames or not isinstance(layout, PackedByGridLayout):
        return call
    items: list[MediaItem] = []
    for item in call.items:
        t, h, w = item.sizes[:3]
        if t == 1:
            items.append(item)
            continue
        rows = h * w
        grid = torch.tensor([[1, h, w]], dtype=item.fields[1].dtype, device=item.fields[1].device)
        for f in range(t):
            fields = tuple(
                grid
                if i == 1
                else value[f * rows : (f + 1) * rows]
                if value.dim() and value.shape[0] == t * rows
                else value
                for i, value in enumerate(item.fields)
            )
            items.append(MediaItem(fields=fields, cost=rows, sizes=(1, h, w)))
    return MediaCall(spec=call.spec, items=tuple(items))


def own_items(
    layout: MediaLayout, tower: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    """``output`` of a call a rank ran unbalanced (eval or ``no_grad``) reduced to the
    items named for it, as a balanced call would return them."""
    needs = take_needs()
    if needs is None:
        return output
    call = split_frames(layout, layout.split_call(tower, args, kwargs))
    weights = [item.fields[0].shape[0] for item in call.items]
    return select_items(layout, output, weights, needs)


def items_of_tokens(
    tokens_per_item: Sequence[int], ordinals: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The items that a shard's media tokens come from, and where each token's row is.

    Args:
        tokens_per_item: the media tokens each item of the call becomes, in call order
            (an image's tokens, a frame's).
        ordinals: the shard's media tokens, as positions among all media tokens of the
            call (increasing; a load-balanced CP shard may hold two runs of them).

    Returns:
        The items (increasing), and per ordinal its row among the rows of those items'
        features put one after another.

    Raises:
        ValueError: an ordinal outside the call's tokens, or not increasing.
    """
    starts = [0]
    for count in tokens_per_item:
        starts.append(starts[-1] + int(count))
    if list(ordinals) != sorted(set(ordinals)) or any(not 0 <= o < starts[-1] for o in ordinals):
        raise ValueError(
            f"media token ordinals must increase within [0, {starts[-1]}), got {list(ordinals)}"
        )
    item_of = [bisect.bisect_right(starts, o) - 1 for o in ordinals]
    items = tuple(sorted(set(item_of)))
    offset = {}
    rows = 0
    for item in items:
        offset[item] = rows
        rows += int(tokens_per_item[item])
    return items, tuple(offset[i] + o - starts[i] for i, o in zip(item_of, ordinals, strict=True))
