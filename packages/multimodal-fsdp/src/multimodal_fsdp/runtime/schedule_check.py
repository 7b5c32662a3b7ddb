"""Fail fast, instead of hanging, when ranks would run different FSDP collectives.

All ranks must run the same FSDP units in the same order. Code that runs only with
some media and owns units (a *media region*: a tower only ranks with images run, a
cross-attention layer text-only batches skip) breaks that, and the job hangs or mixes
up data.

[`ScheduleCheck`][multimodal_fsdp.runtime.schedule_check.ScheduleCheck] has the ranks
agree on *where they are* at the few points where schedules can part: a region's entry
when it is a unit, the first all-gather of each *part* of a region call (an encoder
holding a layer stack, or the region's trunk when it comes first), the first unit after
the forward starts and after each region call, the unit that follows a region, and the
forward's end when a region runs last. There the ranks meet at the model's
[agreement][fsdp_core.rank_agreement] (the c10d store, no collective); differing
positions raise the same
[`UnevenMediaError`][multimodal_fsdp.runtime.schedule_check.UnevenMediaError] on every
rank before any mismatched collective. Recomputation inside backward is not checked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final

from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_core import ShardingPlan
from fsdp_core.containers import is_module_container, is_under, unwrap_module
from fsdp_core.internals import GRAPH_TASK, Probe, in_backward
from fsdp_core.rank_agreement import Meeting, RankAgreement, agreement_of, kind_of, payload_of
from fsdp_core.runtime import RuntimeHook

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = [
    "MediaRegion",
    "ScheduleCheck",
    "ScheduleCheckRuntimeHook",
    "ScheduleLayout",
    "UnevenMediaError",
    "plan_schedule_layout",
]

logger = logging.getLogger(__name__)

NAME = "schedule_check"

#: The kind of this hook's values at the agreement.
POSITION: Final = "media"

_CALL_BITS = 24  # the call ordinal's share of a position token
_AT_CALL: Final = -2  # the "position" of a rank that is at a call of the model


class UnevenMediaError(RuntimeError):
    """Ranks are about to run different FSDP collectives (different media per rank)."""


@dataclass(frozen=True)
class MediaRegion:
    """A module whose calls depend on the batch and that owns FSDP units."""

    path: str
    kind: str  # "tower", "projector" or "decoder layer"
    units: tuple[str, ...]
    #: A fully frozen tower or projector (its units come from ``per_layer``).
    frozen: bool = False


@dataclass(frozen=True)
class ScheduleLayout:
    """Where the checkpoints sit, in the model's registration (forward) order.

    ``successors`` are units that follow a region; ``end_check`` says a region has no
    unit after it. ``parts`` maps each module inside a region where a unit all-gathers
    to its part: an encoder's path, or the region's own path for its trunk.
    """

    regions: tuple[MediaRegion, ...]
    units: tuple[str, ...]
    successors: frozenset[str]
    end_check: bool
    #: Modules in forward order: ("enter", region) / ("unit", path) / ("exit", region).
    order: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    #: Where the parallelizer sets ``per_layer`` (as its options read), '' when nowhere:
    #: ``uneven_media=True`` is refused with it, so the error's advice must say so.
    per_layer: str = field(default="", compare=False)
    #: (module path, part) for every all-gathering module inside a region (see above).
    parts: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def sites(self) -> tuple[str, ...]:
        """Every checkpoint position (regions, units, the end); tokens index into it."""
        return (*(r.path for r in self.regions), *self.units, "<end of forward>")

    def checkpoints_per_forward(self) -> int:
        """Checkpoints of one forward in which every module runs once, in order.

        Returns:
            The number of checkpoints.
        """
        walk = _Walk()
        region_paths = {r.path for r in self.regions}
        parts = dict(self.parts)
        count = 0
        for event, path in self.order:
            if event == "enter":
                count += walk.enter(path, parts.get(path))
            elif event == "exit":
                walk.exit()
            else:
                follows = path in self.successors and path not in region_paths
                count += walk.unit(path, parts.get(path), follows=follows)
        return count + int(self.end_check)


class _Walk:
    """Where one forward is, and whether a module's all-gather there is a checkpoint:
    shared by the check and the layout's count."""

    def __init__(self) -> None:
        self.armed = True
        #: [region, part entered last] of each region call now running, innermost last.
        self.inside: list[list[str | None]] = []

    def enter(self, region: str, own: str | None) -> bool:
        """A region call starts (a checkpoint when the region is a unit itself)."""
        self.armed = False
        self.inside.append([region, own])
        return own is not None

    def exit(self) -> None:
        if self.inside:
            self.inside.pop()
        self.armed = True

    def unit(self, path: str, part: str | None, *, follows: bool) -> bool:
        """Inside a region call, a checkpoint where it enters a part (the trunk only as
        the call's first); else the first unit after the start or a region."""
        if self.inside and is_under(path, str(self.inside[-1][0])):
            region, current = self.inside[-1]
            if part is None or part == current or (part == region and current is not None):
                return False
            self.inside[-1][1] = part
            return True
        checkpoint = self.armed or follows
        self.armed = False  # already False when this is no checkpoint
        return checkpoint


def plan_schedule_layout(
    model: nn.Module, plan: ShardingPlan, regions: Sequence[MediaRegion], *, per_layer: str = ""
) -> ScheduleLayout | None:
    """The checkpoints for ``regions`` of ``plan``.

    Args:
        model: the planned model.
        plan: its plan.
        regions: the plan's media regions.
        per_layer: where the parallelizer sets ``per_layer`` ('' when nowhere).

    Returns:
        The layout, or None.
    """
    if not regions:
        return None
    index = {name: position for position, (name, _) in enumerate(model.named_modules())}
    member_paths = sorted(
        {path for unit in plan.units if not unit.is_root for path in unit.paths},
        key=lambda p: index[p],
    )
    successors: set[str] = set()
    end_check = False
    events: list[tuple[int, int, str, str]] = []
    for region in regions:
        last = max(index[name] for name in index if is_under(name, region.path))
        after = [p for p in member_paths if index[p] > last and not is_under(p, region.path)]
        if after:
            successors.add(after[0])
        else:
            end_check = True
        events.append((index[region.path], 0, "enter", region.path))
        events.append((last, 2, "exit", region.path))
    for path in member_paths:
        events.append((index[path], 1, "unit", path))
    order = tuple((event, path) for _, _, event, path in sorted(events))
    # Where each unit all-gathers: its first module in forward (registration) order.
    gathers = [
        min(unit.paths, key=lambda p: index[p])
        for unit in plan.units
        if not unit.is_root and unit.paths
    ]
    parts = tuple(
        (path, _part(model, region.path, path))
        for path in sorted(gathers, key=lambda p: index[p])
        for region in regions
        if is_under(path, region.path)
    )
    return ScheduleLayout(
        regions=tuple(regions),
        units=tuple(member_paths),
        successors=frozenset(successors),
        end_check=end_check,
        order=order,
        per_layer=per_layer,
        parts=parts,
    )


def _part(model: nn.Module, region: str, path: str) -> str:
    """The part of ``region`` that ``path`` lies in: the child on the way (through
    wrappers and module dicts) when it holds a layer stack, else the region (its trunk)."""
    current = model.get_submodule(region)
    part = region
    names = path[len(region) + 1 :].split(".") if path != region else []
    for position, name in enumerate(names):
        child = current.get_submodule(name)
        part = f"{part}.{name}"
        if unwrap_module(child) is unwrap_module(current):
            current = child  # inside a wrapper of the same module: not a part yet
            continue
        following = names[position + 1] if position + 1 < len(names) else ""
        if is_module_container(child) and following and not following.isdecimal():
            part = f"{part}.{following}"
            child = child.get_submodule(following)
        if any(is_module_container(module) for module in child.modules()):
            return part
        break
    return region


class ScheduleCheck:
    """The installed check; its hooks run before FSDP's own, so a checkpoint comes before
    the all-gather of the unit it guards.

    Args:
        model: the sharded model.
        layout: the planned checkpoints.
        agreement: the ranks' store-based agreement the checkpoints use.
    """

    name: str = NAME

    def __init__(self, model: nn.Module, layout: ScheduleLayout, agreement: RankAgreement) -> None:
        self.layout = layout
        self.agreement = agreement
        # A position explains a meeting before a call does: a rank with one tower call
        # more meets the others' next call there.
        agreement.register(POSITION, self._explain, self._describe_value, first=True)
        self._parts = dict(layout.parts)
        self._start()
        handles = [model.register_forward_pre_hook(self._start, prepend=True)]
        for region in layout.regions:
            module = model.get_submodule(region.path)
            handles.append(module.register_forward_pre_hook(self._enter(region.path), prepend=True))
            handles.append(module.register_forward_hook(self._exit, always_call=True))
        region_paths = {region.path for region in layout.regions}
        for path in layout.units:
            if path in region_paths:
                continue  # a region that is a unit itself: its entry checkpoint covers it
            if _covered(path, layout):
                continue  # inside a hooked unit: it never checkpoints (see ``_covered``)
            module = model.get_submodule(path)
            handles.append(module.register_forward_pre_hook(self._unit(path), prepend=True))
        handles.append(model.register_forward_hook(self._end))
        self._handles: list[RemovableHandle] = handles

    def _site(self, path: str, *, region: bool) -> int:
        if region:
            return next(i for i, r in enumerate(self.layout.regions) if r.path == path)
        return len(self.layout.regions) + self.layout.units.index(path)

    def _start(self, *_: object) -> None:
        self._calls = [0] * len(self.layout.sites)
        self._walk = _Walk()
        #: Checkpoints run in the last forward (for tests and the benchmark).
        self.last_checkpoints = 0

    def _checkpoint(self, site: int) -> None:
        self._calls[site] += 1
        self.last_checkpoints += 1
        token = (site << _CALL_BITS) + min(self._calls[site], (1 << _CALL_BITS) - 1)
        self.agreement.meet(
            POSITION, str(token), what=f"the media checkpoint {self._describe(token)}"
        )

    def _token(self, value: str) -> int:
        """The position of a value; -2 for a rank at a call of the model instead."""
        return int(payload_of(value)) if kind_of(value) == POSITION else _AT_CALL

    def _explain(self, meeting: Meeting) -> Exception | None:
        """``UnevenMediaError`` when the ranks' positions differ (a rank at a call of the
        model counts as at no checkpoint)."""
        values = dict(meeting.values)
        if len(set(values.values())) <= 1 and not (meeting.timed_out_s and meeting.elsewhere):
            return None
        positions = [
            (r, self._token(values[r]) if r in values else -1)
            for r in sorted({*values, *meeting.elsewhere})
        ]
        return UnevenMediaError(self._message(positions))

    def _describe_value(self, value: str) -> str:
        return f"the media checkpoint {self._describe(self._token(value))}"

    def _describe(self, token: int) -> str:
        if token == _AT_CALL:
            return "done with this forward's media (at the model's next call)"
        if token < 0:
            return "nowhere known"
        site, call = token >> _CALL_BITS, token & ((1 << _CALL_BITS) - 1)
        name = self.layout.sites[site]
        if name.startswith("<"):
            return f"at the {name.strip('<>')}"
        region = next((r for r in self.layout.regions if is_under(name, r.path)), None)
        inside = f" in {region.kind} {region.path!r}" if region and region.path != name else ""
        return f"about to run {name!r}{inside} (call {call} of this forward)"

    def _message(self, positions: list[tuple[int, int]]) -> str:
        by_token: dict[int, list[int]] = {}
        for rank, token in positions:
            by_token.setdefault(token, []).append(rank)
        where = "; ".join(
            f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} {self._describe(token)}"
            for token, ranks in sorted(by_token.items(), key=lambda item: item[1][0])
        )
        regions = ", ".join(f"{r.kind} {r.path!r}" for r in self.layout.regions)
        fold = (
            "pass uneven_media=True to the parallelizer (these modules then join the root "
            "unit: gathered for the whole step, any media on any rank)"
        )
        # balance_media keeps every unit and trains under any media distribution: ranks
        # take part in every tower call and join the projectors and layers they skip.
        fixes = [
            "pass balance_media=True to the parallelizer (every rank then takes part in "
            "each tower call and joins the projector calls and media-dependent layers it "
            "has no media for)"
        ]
        if self.layout.per_layer:
            # uneven_media=True is refused with per_layer: the policy changes first.
            swap = (
                "use frozen_multimodal_sharding='root' or 'replicate' instead of "
                f"'per_layer' (now {self.layout.per_layer})"
            )
            all_frozen = all(r.frozen for r in self.layout.regions)
            fixes.append(swap if all_frozen else f"{swap} and {fold}")
        else:
            fixes.append(fold)
        fixes.append("give every rank the same media calls in each step")
        return (
            f"ranks are about to run different FSDP collectives: {where}. These modules "
            f"run only with media and own FSDP units: {regions}. Ranks with different "
            "media (images on some ranks only, a different number of tower calls, "
            "text-only batches that skip cross-attention layers) run them a different "
            "number of times, which would hang. To fix it, " + "; or ".join(fixes) + "."
        )

    def _enter(self, path: str) -> Any:
        site = self._site(path, region=True)
        own = self._parts.get(path)  # the region is a unit: its all-gather comes first

        def hook(*_: object) -> None:
            if not in_backward() and self._walk.enter(path, own):
                self._checkpoint(site)

        return hook

    def _exit(self, *_: object) -> None:
        if not in_backward():
            self._walk.exit()

    def _unit(self, path: str) -> Any:
        site = self._site(path, region=False)
        follows_region = path in self.layout.successors
        part = self._parts.get(path)

        def hook(*_: object) -> None:
            if not in_backward() and self._walk.unit(path, part, follows=follows_region):
                self._checkpoint(site)

        return hook

    def _end(self, *_: object) -> None:
        if self.layout.end_check and not in_backward():
            self._checkpoint(len(self.layout.sites) - 1)

    def remove(self) -> None:
        """Remove the hooks and leave the agreement."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.agreement.unregister(POSITION)


def _covered(path: str, layout: ScheduleLayout) -> bool:
    """Whether the unit at ``path`` lies inside another hooked unit whose hook always runs
    first in the same state (fp32 norm units in a vision block), so it needs no hook of
    its own (which a regionally compiled block would trace)."""
    if path in layout.successors:
        return False
    parts = dict(layout.parts)
    region_paths = {region.path for region in layout.regions}
    for outer in layout.units:
        if outer == path or outer in region_paths or not is_under(path, outer):
            continue
        if any(is_under(region, outer) for region in region_paths):
            continue
        if parts.get(path) in (None, parts.get(outer)):
            return True
    return False


def _ranks(ranks: list[int], shown: int = 8) -> str:
    """``rank 3`` / ``ranks 0, 2`` / ``ranks 0, 1, ... (and 9 more)``."""
    text = ", ".join(str(rank) for rank in ranks[:shown])
    if len(ranks) > shown:
        text += f" (and {len(ranks) - shown} more)"
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


@dataclass(frozen=True)
class ScheduleCheckRuntimeHook(RuntimeHook):
    """The ``schedule_check`` runtime hook; plan data: the layout. No collective."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[Probe, ...]] = (GRAPH_TASK,)

    layout: ScheduleLayout

    def install(self, model: nn.Module, *, dims: ParallelDims) -> ScheduleCheck:
        """The checkpoints agree over every rank that runs the model's forward."""
        logger.info(
            "schedule check on %d media regions: %s",
            len(self.layout.regions),
            [region.path for region in self.layout.regions],
        )
        return ScheduleCheck(model, self.layout, agreement_of(model, dims))
