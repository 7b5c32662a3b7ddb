"""The parameter-memory timeline: when each unit's parameters are gathered.

A timeline over module positions (pre-order ``named_modules``, the forward order of the
models this project serves): each unit is gathered from its first member's forward to its
last member's, and kept until backward when not resharded; in backward from its
pre-backward to its post-backward, the implicit prefetch gathering the next one early.
Without the prefetch guard
([`multimodal_fsdp.runtime.prefetch_guard`][multimodal_fsdp.runtime.prefetch_guard]) the
unit finishing its forward right after a unit without backward re-gathers that unit, which
is wasted communication. All-gather output buffers are left to the activation trace.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from torch import nn

from fsdp_core.collective_count import CommTally
from fsdp_core.plan import UnitPlan

__all__ = ["effective_reshard", "kept_after_forward"]


@dataclass
class _Unit:
    """One unit of a plan placed on the timeline, with what it gathers and issues."""

    plan: UnitPlan
    params: list[tuple[str, nn.Parameter]]
    start: int
    end: int
    reshard: bool | int
    runs_backward: bool
    gathered: int
    sharded: int
    comm: CommTally = field(default_factory=CommTally)
    wasted: CommTally = field(default_factory=CommTally)


def effective_reshard(unit: UnitPlan, shard: int) -> bool | int:
    """What FSDP2 does after forward.

    Args:
        unit: The unit.
        shard: The shard-group size.

    Returns:
        ``True`` to reshard, ``False`` to keep, or the group size to reshard to: root
        ``None`` keeps, others ``None`` reshard; 1 keeps, ``shard`` reshards.
    """
    value = unit.reshard_after_forward
    if value is None:
        return not unit.is_root
    if isinstance(value, bool):
        return value
    if value == 1:
        return False
    if value == shard:
        return True
    return value


def _kept(reshard: bool | int, size: int) -> int:
    return 0 if reshard is True else size if reshard is False else size // int(reshard)


def kept_after_forward(unit: UnitPlan, size: int, shard: int) -> int:
    """The keep rule of the parameter timeline and the activation replay.

    Args:
        unit: The unit.
        size: Its gathered bytes.
        shard: The shard-group size.

    Returns:
        The gathered bytes ``unit`` keeps after forward.
    """
    return _kept(effective_reshard(unit, shard), size)


def _post_forward_order(units: list[_Unit]) -> list[_Unit]:
    """Units in the order their forwards finish (inner units first on a tie)."""
    return sorted((u for u in units if u.params), key=lambda u: (u.end, -u.start, u.plan.is_root))


def _prefetch_waste(units: list[_Unit], shard: int) -> None:
    """Without the guard, a unit's pre-backward re-gathers its predecessor without backward."""
    if shard <= 1:
        return
    order = _post_forward_order(units)
    for previous, current in itertools.pairwise(order):
        if current.runs_backward and not previous.runs_backward and previous.reshard is not False:
            previous.wasted.add("backward", "all_gather", previous.gathered)


def _peaks(units: list[_Unit], end: int, *, guard: bool) -> tuple[int, int]:
    """Peak gathered parameter bytes in forward and in backward (timeline model)."""
    forward: list[tuple[int, int, int]] = []  # (start, stop, bytes) on module positions
    backward: list[tuple[int, int, int]] = []
    order = _post_forward_order(units)
    prefetched_at = {
        id(prev): cur.end for prev, cur in itertools.pairwise(order) if cur.runs_backward
    }
    for u in units:
        if not u.params:
            continue
        full = u.gathered
        forward.append((u.start, u.end, full))
        kept = _kept(u.reshard, full)
        if kept:
            forward.append((u.end, end, kept))
        early = prefetched_at.get(id(u), u.end)
        if u.runs_backward:
            if u.reshard is False:
                backward.append((u.start, end, full))
            else:
                top = max(u.end, early)
                backward.append((u.start, top, full))
                if kept and top < end:
                    backward.append((top, end, kept))
        elif u.reshard is False:
            backward.append((0, end, full))
        else:
            if kept:
                backward.append((0, end, kept))
            if not guard and id(u) in prefetched_at:
                backward.append((0, early, full))
    return _sweep_max(forward), _sweep_max(backward)


def _sweep_max(segments: list[tuple[int, int, int]]) -> int:
    """Largest total of ``bytes`` over half-open ``[start, stop)`` segments at one point."""
    events: list[tuple[int, int]] = []
    for start, stop, nbytes in segments:
        if stop > start:
            events += [(start, nbytes), (stop, -nbytes)]
    best = live = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1] > 0)):  # ends before starts
        live += change
        best = max(best, live)
    return best
