"""Planned calls as units to shard.

Every way of sharding (a plan, ``_fully_shard_module``, the free functions) plans its
units as [`ShardCall`][fsdp_core.plan.ShardCall]s
([`group_calls`][fsdp_core.shard_calls.group_calls] for one module alone), turns them into
units with options ([`call_units`][fsdp_core.shard_calls.call_units]) and hands those to
[`shard_units`][fsdp_core.sharding.shard_units].
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_core.containers import is_under
from fsdp_core.plan import ShardCall, UnitPlan
from fsdp_core.sharding import ShardOptions, ShardTarget

__all__ = ["call_units", "check_offload_given_once", "group_calls", "group_units"]


def group_calls(
    module: nn.Module,
    groups: Sequence[tuple[Sequence[str], MixedPrecisionPolicy]],
    options: ShardOptions,
) -> tuple[ShardCall, ...]:
    """The plan of ``module`` alone: a call per group (paths relative to ``module``, with
    the group's mixed precision), then ``module`` itself with ``options.mp_policy``; each
    call ignores the parameters of ``options.ignored_params`` under its members.

    Args:
        module: the module planned alone.
        groups: ``(member paths, policy)`` per inner unit.
        options: the module's own sharding options.

    Returns:
        The calls, inner units first.
    """
    ignored = options.ignored_params or frozenset()
    names = [name for name, param in module.named_parameters() if param in ignored]
    planned = [*((tuple(paths), policy) for paths, policy in groups), (("",), options.mp_policy)]
    reshard = options.reshard_after_forward
    calls = []
    for paths, policy in planned:
        under = tuple(n for n in names if any(is_under(n, path) for path in paths))
        unit = UnitPlan(paths, policy, reshard, under, role="root" if paths == ("",) else "group")
        calls.append(ShardCall(paths, policy, reshard, under, units=(unit,)))
    return tuple(calls)


def call_units(
    root: nn.Module,
    calls: Sequence[ShardCall],
    *,
    mesh: DeviceMesh,
    offload_policy: OffloadPolicy | None = None,
) -> list[tuple[ShardTarget, ShardOptions]]:
    """The units ``calls`` make (paths relative to ``root``), in order, each with its own
    checked options. ``offload_policy`` offloads the calls without their own
    ``ShardCall.offload_policy``; both at once is a ``ValueError``.

    Args:
        root: the module the calls' paths are relative to.
        calls: the planned calls.
        mesh: the data-parallel mesh.
        offload_policy: offload for every unit of calls that say nothing.

    Returns:
        ``(target, options)`` per unit, in order.
    """
    check_offload_given_once(calls, offload_policy)
    named = dict(root.named_parameters())
    units: list[tuple[ShardTarget, ShardOptions]] = []
    for call in calls:
        members = [root.get_submodule(path) if path else root for path in call.paths]
        options = ShardOptions(
            mesh=mesh,
            mp_policy=call.mp_policy,
            offload_policy=offload_policy if call.offload_policy is None else call.offload_policy,
            reshard_after_forward=call.reshard_after_forward,
            ignored_params=frozenset(named[name] for name in call.ignored_param_names),
        )
        units.append((members[0] if len(members) == 1 else members, options))
    return units


def check_offload_given_once(calls: Sequence[ShardCall], offload_policy: object) -> None:
    """Refuse an ``offload_policy`` for every unit beside calls that offload on their own.

    Args:
        calls: the planned calls.
        offload_policy: the caller's offload for every unit, if any.

    Raises:
        ValueError: both are given.
    """
    if offload_policy is None:
        return
    own = [call for call in calls if call.offload_policy is not None]
    if own:
        labels = ", ".join(repr(unit.label) for call in own[:3] for unit in call.units[:1])
        more = f" and {len(own) - 3} more" if len(own) > 3 else ""
        raise ValueError(
            f"the plan already offloads {len(own)} of its calls ({labels}{more}), so "
            f"offload_policy={offload_policy!r} for every unit is ambiguous; nothing was "
            "sharded. Decide offloading in one place: per part when planning (e.g. "
            "MultimodalParallelizer(offload=...)) or offload_policy= for every unit."
        )


def group_units(
    module: nn.Module,
    groups: Sequence[tuple[Sequence[str], MixedPrecisionPolicy]],
    options: ShardOptions,
) -> list[tuple[ShardTarget, ShardOptions]]:
    """The units of ``module`` alone, planned by
    [`group_calls`][fsdp_core.shard_calls.group_calls] (its groups, then itself).

    Args:
        module: the module planned alone.
        groups: ``(member paths, policy)`` per inner unit.
        options: the module's own sharding options.

    Returns:
        ``(target, options)`` per unit, in order.
    """
    calls = group_calls(module, groups, options)
    return call_units(module, calls, mesh=options.mesh, offload_policy=options.offload_policy)
