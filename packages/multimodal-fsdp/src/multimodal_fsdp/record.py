"""What ``MultimodalParallelizer.plan()`` found and decided, recorded in the plan.

Later stages (costs, chooser, CLI) read it from
[`ShardingPlan.records`][fsdp_core.plan.ShardingPlan.records] instead of discovering the
model again. Plain data, not part of plan equality.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fsdp_core import ShardingPlan
from fsdp_core.containers import is_under
from multimodal_fsdp.policy import FrozenMultimodalSharding, FrozenPolicies
from multimodal_fsdp.runtime.schedule_check import MediaRegion

__all__ = ["MultimodalRecord", "PlannedPart", "media_regions_of", "plan_record"]


@dataclass(frozen=True)
class PlannedPart:
    """One discovered tower or projector as planned: its path, discovery rule, frozen
    and trainable submodules, and policy."""

    path: str
    rule: str
    modality: str
    role: str
    frozen: tuple[str, ...]
    trainable: tuple[str, ...]
    policy: FrozenMultimodalSharding

    @property
    def fully_frozen(self) -> bool:
        return bool(self.frozen) and not self.trainable


@dataclass(frozen=True)
class MultimodalRecord:
    """The multimodal planner's record in a plan (see the module doc)."""

    parts: tuple[PlannedPart, ...]
    #: Decoder layers that run only with media (``find_media_conditional_layers``).
    conditional_layers: tuple[str, ...]
    #: The media regions of the plan's units, as planned.
    media_regions: tuple[MediaRegion, ...]
    #: The frozen-tower policies the plan was made with (each part's: ``PlannedPart.policy``).
    policies: FrozenPolicies
    uneven_media: bool
    #: Towers whose calls ``balance_media=True`` spreads over every rank (no media regions).
    balanced_towers: tuple[str, ...] = ()
    #: Projectors and media-dependent decoder layers that ``balance_media=True`` makes
    #: ranks without media join (no media regions).
    joined: tuple[str, ...] = ()


def plan_record(plan: ShardingPlan) -> MultimodalRecord | None:
    """The multimodal record of ``plan``.

    Args:
        plan: any plan.

    Returns:
        Its ``MultimodalRecord``, or None for plans made otherwise.
    """
    return plan.record(MultimodalRecord)


def media_regions_of(
    parts: Iterable[PlannedPart],
    conditional_layers: Iterable[str],
    plan: ShardingPlan,
    *,
    balanced: Iterable[str] = (),
) -> list[MediaRegion]:
    """Modules that only run with media and own units of ``plan``: towers and projectors
    with units inside, then media-dependent decoder layers that are units themselves.

    Args:
        parts: the planned towers' and projectors' parts.
        conditional_layers: the media-dependent decoder layers' paths.
        plan: the plan (its units).
        balanced: the modules ``balance_media`` makes every rank call.

    Returns:
        The media regions, in that order.
    """
    members = [path for unit in plan.units if not unit.is_root for path in unit.paths]
    skip = set(balanced)
    regions: list[MediaRegion] = []
    for part in parts:
        if part.path in skip:
            continue
        inside = tuple(p for p in members if is_under(p, part.path))
        if inside:
            regions.append(MediaRegion(part.path, part.role, inside, frozen=part.fully_frozen))
    taken = [r.path for r in regions]
    for path in conditional_layers:
        if path in members and path not in skip and not any(is_under(path, r) for r in taken):
            regions.append(MediaRegion(path, "decoder layer", (path,)))
    return regions
