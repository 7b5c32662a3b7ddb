"""The hook objects of a plan's entries, for the estimates: each hook owns its cost model.

A plan made by ``plan()`` carries every runtime hook as an object with its plan data
([`HookPlan.hook`][fsdp_core.runtime.HookPlan]), and the estimates ask those objects what
they cost ([`RuntimeHook.collectives`][fsdp_core.runtime.RuntimeHook.collectives]). An entry
built by hand may name a hook without its object; the one place that rebuilds it is here,
above the hooks and below the estimates, so that no estimate imports a hook module: the
core hooks without plan data from their name, the schedule check laid out from the plan's
record of its media regions. Anything else stays without an object and costs nothing, as
the estimates have always counted it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.accumulation import AccumulationWarmupRuntimeHook
from fsdp_core.runtime import HookPlan, RuntimeHook
from fsdp_core.unused_params import UnusedParamsRuntimeHook
from multimodal_fsdp.record import media_regions_of, plan_record
from multimodal_fsdp.runtime.schedule_check import ScheduleCheckRuntimeHook, plan_schedule_layout

__all__ = ["planned_hooks"]


def planned_hooks(
    plan: ShardingPlan, model: nn.Module
) -> tuple[tuple[HookPlan, RuntimeHook | None], ...]:
    """Each hook entry of ``plan``, in the plan's order, with its hook object: the one the
    plan carries, else the one rebuilt for a hand-built entry (see the module doc), else
    ``None``."""
    return tuple(
        (planned, planned.hook if planned.hook is not None else _rebuilt(planned, plan, model))
        for planned in plan.hooks
    )


def _schedule_check(plan: ShardingPlan, model: nn.Module) -> RuntimeHook | None:
    """The schedule check laid out from the media regions the plan's record names (none
    without a record or a region)."""
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
    AccumulationWarmupRuntimeHook.name: lambda _plan, _model: AccumulationWarmupRuntimeHook(),
    UnusedParamsRuntimeHook.name: lambda _plan, _model: UnusedParamsRuntimeHook(),
    ScheduleCheckRuntimeHook.name: _schedule_check,
}


def _rebuilt(planned: HookPlan, plan: ShardingPlan, model: nn.Module) -> RuntimeHook | None:
    rebuild = _REBUILD.get(planned.name)
    return None if rebuild is None else rebuild(plan, model)
