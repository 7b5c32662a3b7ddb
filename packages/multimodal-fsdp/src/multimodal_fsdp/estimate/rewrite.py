"""Plan rewriting: variants of a plan that answer what-if questions.

A rewrite takes a [`ShardingPlan`][fsdp_core.plan.ShardingPlan] and returns another one, so
that [`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs] and
[`multimodal_fsdp.measure.comm`][multimodal_fsdp.measure.comm] can cost or run the variant exactly
like the
original (for example, to count what grouped units save over one unit per member module).
"""

from __future__ import annotations

import dataclasses

from fsdp_core import ShardingPlan
from fsdp_core.containers import is_under
from fsdp_core.plan import ShardCall, UnitPlan

__all__ = ["ungroup_units"]


def ungroup_units(plan: ShardingPlan, role: str | None = None) -> ShardingPlan:
    """The same plan with every grouped unit (of ``role``, if given) split into one
    unit per member module: the layout torch without grouped casting would need,
    used to count what grouping saves."""
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    calls: list[ShardCall] = []
    for call in plan.calls:
        if not call.is_group or (role is not None and any(u.role != role for u in call.units)):
            calls.append(call)
            continue
        for path in call.paths:
            ignored = tuple(n for n in call.ignored_param_names if is_under(n, path))
            unit = UnitPlan(
                paths=(path,),
                mp_policy=call.mp_policy,
                reshard_after_forward=call.reshard_after_forward,
                ignored_param_names=ignored,
                role=call.units[0].role,
                offload_policy=call.offload_policy,
            )
            calls.append(
                ShardCall(
                    paths=(path,),
                    mp_policy=call.mp_policy,
                    reshard_after_forward=call.reshard_after_forward,
                    ignored_param_names=ignored,
                    units=(unit,),
                    offload_policy=call.offload_policy,
                )
            )
    return dataclasses.replace(plan, calls=tuple(calls))
