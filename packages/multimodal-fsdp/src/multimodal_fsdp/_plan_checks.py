"""Checks the multimodal planner runs while planning (offload, a given discovery,
``uneven_media`` folding), its offload notes and the small lookups it shares."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.containers import is_under
from fsdp_core.plan import ShardCall, format_offload, unit_parameters
from fsdp_core.plan_context import PlanContext
from multimodal_fsdp.model_discovery import Discovery, DiscoveryOptions
from multimodal_fsdp.offload import OffloadPart, PartOffload, _offload_text
from multimodal_fsdp.parts import MultimodalParts, summarise
from multimodal_fsdp.policy import FrozenMultimodalSharding, frozen_policy
from multimodal_fsdp.runtime.schedule_check import MediaRegion


def _part_of(name: str, found: Discovery) -> tuple[OffloadPart, str]:
    """The part (and its module path) that the module or parameter ``name`` belongs to."""
    for part in found.parts:
        if part.found.path and is_under(name, part.found.path):
            return part.found.role, part.found.path
    return "language_model", ""


def _offload_kept_notes(
    offload: PartOffload, ctx: PlanContext[Discovery], found: Discovery
) -> list[str]:
    """Notes for offloaded parts whose replicated parameters stay on the device."""
    notes = []
    for part in found.parts:
        if offload.for_part(part.found.role) is None:
            continue
        kept = [n for n in ctx.replicated_param_names if is_under(n, part.found.path)]
        if kept:
            notes.append(
                f"{part.found.role} {part.found.path!r} is offloaded but its "
                f"{len(kept)} replicated parameters ({summarise(kept, 2)}) stay on the "
                "device (outside FSDP)"
            )
    return notes


def _check_offload(
    offload: PartOffload,
    found: Discovery,
    parts: Iterable[tuple[MultimodalParts, FrozenMultimodalSharding]],
    ctx: PlanContext[Discovery],
    calls: tuple[ShardCall, ...],
) -> None:
    """Every parameter of a part sits in a unit offloaded as its part is."""
    for part, policy in parts:
        role: OffloadPart = part.found.role
        offloaded = offload.for_part(role)
        if part.frozen and frozen_policy(policy).replicates and offloaded is not None:
            raise ValueError(
                f"offload gives the {role} {part.found.path!r} "
                f"{format_offload(offloaded)}, but its frozen-tower "
                f"policy {policy!r} keeps its frozen parameters whole on every device, "
                "outside FSDP, whose offload moves only sharded parameters; use "
                "frozen_multimodal_sharding='per_layer' for it (a unit per block and one "
                f"for the rest), or do not offload the {role}"
            )
    plan = ShardingPlan(calls=calls, ignored_param_names=tuple(ctx.ignored_param_names))
    for unit, params in zip(plan.units, unit_parameters(plan, ctx.model), strict=True):
        for name, _ in params:
            role, path = _part_of(name, found)
            if offload.for_part(role) == unit.offload_policy:
                continue
            where = (
                "joins the root unit, which holds the language model"
                if unit.is_root
                else f"sits in the unit {unit.label!r}"
            )
            raise ValueError(
                f"offload {offload.label()}: the {role} {path or '<root>'!r} is "
                f"offloaded as {_offload_text(offload.for_part(role))}, but its "
                f"parameter {name!r} {where}, offloaded as "
                f"{_offload_text(unit.offload_policy)}. A frozen tower or projector under "
                "the 'root' policy (or folded by uneven_media=True) has no units of its "
                "own; use frozen_multimodal_sharding='per_layer' for it (a unit per block "
                "and one for the rest), or give it the language model's offload"
            )


def _check_discovery(discovery: object, model: nn.Module, options: DiscoveryOptions) -> None:
    """A discovery given to ``plan()`` must be ``model``'s as it is now."""
    if not isinstance(discovery, Discovery):
        raise TypeError(
            f"discovery must be a multimodal_fsdp Discovery, got {type(discovery).__name__}"
        )
    if not discovery.matches(model, options):
        raise ValueError(
            "the discovery given to plan() is not this model's as it is now (another model, "
            "other discovery options, or parameters frozen or unfrozen since); make it with "
            "parallelizer.discover(model) right before planning, or pass discovery=None"
        )


def _check_folded(regions: Iterable[MediaRegion]) -> None:
    """Under ``uneven_media=True`` no media region may keep units of its own."""
    left = list(regions)
    if left:
        raise ValueError(
            "uneven_media=True folds towers, projectors and media-dependent decoder "
            "layers into the root unit, but these still need units of their own: "
            + "; ".join(f"{r.path!r} ({summarise(r.units)})" for r in left)
            + " (odd-dtype parameters that cannot share the root unit's dtype). "
            "Freeze them (frozen parameters are replicated or join the root), give "
            "them the model's dtype, or use uneven_media=False and the same media "
            "calls on every rank."
        )


def _param_names_under(model: nn.Module, roots: Iterable[str]) -> list[str]:
    prefixes = list(roots)
    return [
        name for name, _ in model.named_parameters() if any(is_under(name, r) for r in prefixes)
    ]


def _compute_dtype(calls: Iterable[ShardCall]) -> torch.dtype | None:
    """The parameter dtype of the root call (the last one, if several)."""
    roots = [call for call in calls if call.paths == ("",)]
    return roots[-1].mp_policy.param_dtype if roots else None
