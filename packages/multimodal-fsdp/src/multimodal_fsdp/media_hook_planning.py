"""Which multimodal runtime hooks a plan gets, and the hook object of each plan entry.

``planned_hooks`` gives the estimates each entry's hook object (to ask
[`collectives`][fsdp_core.runtime.RuntimeHook.collectives]): the one the plan carries,
else, for a hand-built entry, one rebuilt here so that no estimate imports a hook module.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.containers import is_under
from fsdp_core.runtime import HookPlan, RuntimeHook
from fsdp_core.unused_params import UnusedParamsRuntimeHook
from multimodal_fsdp.balance._planned import sharded_on_data_group
from multimodal_fsdp.model_discovery import Discovery
from multimodal_fsdp.record import MultimodalRecord, media_regions_of, plan_record
from multimodal_fsdp.runtime.balance_media import BalanceMediaRuntimeHook
from multimodal_fsdp.runtime.prefetch_guard import PrefetchGuardRuntimeHook, frozen_unit_labels
from multimodal_fsdp.runtime.schedule_check import ScheduleCheckRuntimeHook, plan_schedule_layout

__all__ = ["guarded_frozen_units", "media_hook_plans", "planned_hooks", "shared_params"]


def media_hook_plans(
    found: Discovery,
    plan: ShardingPlan,
    record: MultimodalRecord,
    *,
    per_layer: str,
    group: str | int,
) -> list[HookPlan]:
    """The multimodal runtime hooks of ``plan``: ``prefetch_guard``, ``schedule_check``
    for the recorded media regions, ``balance_media`` for the balanced towers.

    Args:
        found: the model's discovery.
        plan: the finished plan.
        record: what the plan recorded of the discovery.
        per_layer: where ``per_layer`` is set ('' when nowhere).
        group: the ``balance_media_group`` option.

    Returns:
        The hooks' plan entries.
    """
    hooks: list[HookPlan] = []
    model = found.model
    frozen = guarded_frozen_units(found, plan)
    if frozen:
        hooks.append(
            PrefetchGuardRuntimeHook.from_plan(model, plan, frozen).planned(
                reason="frozen units that no gradient reaches are not re-gathered by "
                "FSDP's implicit backward prefetch",
                targets=frozen,
                cost="no collective (saves one all-gather per step)",
            )
        )
    layout = plan_schedule_layout(model, plan, list(record.media_regions), per_layer=per_layer)
    if layout is not None:
        hooks.append(
            ScheduleCheckRuntimeHook(layout).planned(
                reason="media regions own units; ranks agree on their position before "
                "the first all-gather of each encoder a region call runs and after the "
                "call, so uneven media fail on every rank with UnevenMediaError instead "
                "of hanging",
                targets=[r.path for r in layout.regions],
                cost=f"no collective: {layout.checkpoints_per_forward()} meetings at the "
                "c10d store per forward (one call of each region, running all its "
                "encoders); one more per extra region call (per encoder it runs, for a "
                "region holding several)",
            )
        )
    towers = list(record.balanced_towers)
    if towers:
        conditional = set(found.conditional)
        balance = BalanceMediaRuntimeHook.from_plan(
            model,
            plan,
            towers=towers,
            media_only=[*found.paths, *found.conditional],
            joined=[path for path in record.joined if path not in conditional],
            layers=[path for path in record.joined if path in conditional],
            group=group,
        )
        hooks.append(
            balance.planned(reason=balance.describe(), targets=towers, cost=balance.cost())
        )
    return hooks


def shared_params(found: Discovery, plan: ShardingPlan) -> list[str]:
    """The trainable parameters of balanced towers and joined projectors with units, whose
    gradients a TP data group sums (none when one is sharded on a data-group dimension).

    Args:
        found: the model's discovery.
        plan: the finished plan.

    Returns:
        The parameter names.
    """
    record = plan_record(plan)
    if record is None:
        return []
    conditional = set(found.conditional)
    members = [path for unit in plan.units if not unit.is_root for path in unit.paths]
    joined = [
        path
        for path in record.joined
        if path not in conditional and any(is_under(m, path) for m in members)
    ]
    roots = [*record.balanced_towers, *joined]
    if sharded_on_data_group(found.model, roots):
        return []
    return [
        name
        for name, param in found.model.named_parameters()
        if param.requires_grad and any(is_under(name, root) for root in roots)
    ]


def guarded_frozen_units(found: Discovery, plan: ShardingPlan) -> list[str]:
    """Frozen non-root units the prefetch guard watches: with trainable code that runs
    only with media, only tower and projector units (gradients reach the others on the
    ranks with media alone, so the guard's per-rank decision would differ).

    Args:
        found: the model's discovery.
        plan: the finished plan.

    Returns:
        The labels of the units to guard.
    """
    model = found.model
    labels = frozen_unit_labels(model, plan)
    towers = found.paths
    media_only = [*towers, *found.conditional]
    if not labels or not any(
        param.requires_grad
        for name, param in model.named_parameters()
        if any(is_under(name, root) for root in media_only)
    ):
        return labels
    paths = {unit.label: unit.paths for unit in plan.units}
    return [
        label
        for label in labels
        if all(any(is_under(path, tower) for tower in towers) for path in paths[label])
    ]


def planned_hooks(
    plan: ShardingPlan, model: nn.Module
) -> tuple[tuple[HookPlan, RuntimeHook | None], ...]:
    """Each hook entry of ``plan`` with its hook object (carried, rebuilt, or ``None``).

    Args:
        plan: a plan (possibly with hand-built hook entries).
        model: the planned model.

    Returns:
        ``(entry, hook object or None)`` per entry.
    """
    return tuple(
        (planned, planned.hook if planned.hook is not None else _rebuilt(planned, plan, model))
        for planned in plan.hooks
    )


def _schedule_check(plan: ShardingPlan, model: nn.Module) -> RuntimeHook | None:
    """The schedule check laid out from the plan's record (none without regions)."""
    record = plan_record(plan)
    if record is None:
        return None
    regions = media_regions_of(
        record.parts, record.conditional_layers, plan, balanced=record.balanced_towers
    )
    layout = plan_schedule_layout(model, plan, regions)
    return None if layout is None else ScheduleCheckRuntimeHook(layout)


#: Per hook name, how a hand-built entry's object is rebuilt from the plan and model.
_REBUILD: dict[str, Callable[[ShardingPlan, nn.Module], RuntimeHook | None]] = {
    UnusedParamsRuntimeHook.name: lambda _plan, _model: UnusedParamsRuntimeHook(),
    ScheduleCheckRuntimeHook.name: _schedule_check,
}


def _rebuilt(planned: HookPlan, plan: ShardingPlan, model: nn.Module) -> RuntimeHook | None:
    rebuild = _REBUILD.get(planned.name)
    return None if rebuild is None else rebuild(plan, model)
