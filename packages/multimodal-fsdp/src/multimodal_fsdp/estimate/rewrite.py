"""Plan variants that answer what-if questions, costed or run exactly like the original."""

from __future__ import annotations

import dataclasses

from fsdp_core import ShardingPlan
from fsdp_core.containers import is_under
from fsdp_core.plan import ShardCall, UnitPlan

__all__ = ["ungroup_units"]


def ungroup_units(plan: ShardingPlan, role: str | None = None) -> ShardingPlan:
    """The plan without grouped units, to count what grouping saves.

    Args:
        plan: The plan.
        role: Split only the groups of this role (``None``: every group).

    Returns:
        The same plan with each grouped unit split into one unit per member module.

    Raises:
        TypeError: ``plan`` is not a ``ShardingPlan``.
    """
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
                dataclasses.replace(call, paths=(path,), ignored_param_names=ignored, units=(unit,))
            )
    return dataclasses.replace(plan, calls=tuple(calls))
