"""The one path from planned calls to FSDP units.

Every way of sharding (a parallelizer's plan, ``apply_plan`` without a parallelizer, a
framework calling ``_fully_shard_module`` on a module of its choice, the free functions
``fully_shard_dtype_safe``, ``shard_groups_then_module`` and model packages' own) plans
the units of its module as [`ShardCall`][fsdp_core.plan.ShardCall]s, then runs them
here: [`run_calls`][fsdp_core.shard_calls.run_calls] resolves each call's members and
ignored parameters and hands it, with its options as one
[`ShardOptions`][fsdp_core.sharding.ShardOptions], to a shard function, by default
[`shard_unit`][fsdp_core.shard_calls.shard_unit], the only caller of
[`apply_fully_shard`][fsdp_core.sharding.apply_fully_shard].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_core.containers import is_under
from fsdp_core.plan import ShardCall, UnitPlan
from fsdp_core.sharding import ShardOptions, ShardTarget, apply_fully_shard

__all__ = [
    "ShardFn",
    "check_offload_given_once",
    "group_calls",
    "run_calls",
    "shard_groups",
    "shard_unit",
]

#: Makes one planned unit: its target (a module, or modules sharing one unit) and options.
ShardFn = Callable[[ShardTarget, ShardOptions], object]


def shard_unit(target: ShardTarget, options: ShardOptions) -> None:
    """Make ``target`` one FSDP unit with ``options``: the only call of
    [`apply_fully_shard`][fsdp_core.sharding.apply_fully_shard] (and so of torch's
    ``fully_shard``) in the library."""
    apply_fully_shard(target, **options.as_kwargs())


def group_calls(
    module: nn.Module,
    groups: Sequence[tuple[Sequence[str], MixedPrecisionPolicy]],
    options: ShardOptions,
) -> tuple[ShardCall, ...]:
    """The plan of ``module`` alone: a call per group (paths relative to ``module``, with
    the group's mixed precision), then ``module`` itself with ``options.mp_policy``; each
    call ignores the parameters of ``options.ignored_params`` under its members."""
    ignored = options.ignored_params or frozenset()
    names = [name for name, param in module.named_parameters() if param in ignored]
    planned = [*((tuple(paths), policy) for paths, policy in groups), (("",), options.mp_policy)]
    calls = []
    for paths, policy in planned:
        under = tuple(n for n in names if any(is_under(n, path) for path in paths))
        unit = UnitPlan(
            paths=paths,
            mp_policy=policy,
            reshard_after_forward=options.reshard_after_forward,
            ignored_param_names=under,
            role="root" if paths == ("",) else "group",
        )
        calls.append(
            ShardCall(
                paths=paths,
                mp_policy=policy,
                reshard_after_forward=options.reshard_after_forward,
                ignored_param_names=under,
                units=(unit,),
            )
        )
    return tuple(calls)


def run_calls(
    root: nn.Module,
    calls: Iterable[ShardCall],
    *,
    mesh: DeviceMesh,
    offload_policy: OffloadPolicy | None = None,
    shard: ShardFn = shard_unit,
) -> None:
    """Make the units of ``calls`` (paths relative to ``root``, ``""`` is ``root``), in
    order, each through ``shard`` with its own options.

    Each call is offloaded as it says (``ShardCall.offload_policy``); ``offload_policy``
    offloads every unit of calls that say nothing. Both at once would leave it open which
    units offload: a ``ValueError`` before any unit is made."""
    planned = list(calls)
    check_offload_given_once(planned, offload_policy)
    named = dict(root.named_parameters())
    for call in planned:
        members = [root.get_submodule(path) if path else root for path in call.paths]
        ignored = frozenset(named[name] for name in call.ignored_param_names)
        options = ShardOptions(
            mesh=mesh,
            mp_policy=call.mp_policy,
            offload_policy=(offload_policy if call.offload_policy is None else call.offload_policy),
            reshard_after_forward=call.reshard_after_forward,
            ignored_params=ignored or None,
        )
        shard(members[0] if len(members) == 1 else members, options)


def check_offload_given_once(calls: Sequence[ShardCall], offload_policy: object) -> None:
    """Refuse an ``offload_policy`` for every unit beside calls that offload on their own."""
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


def shard_groups(
    module: nn.Module,
    groups: Sequence[tuple[Sequence[str], MixedPrecisionPolicy]],
    options: ShardOptions,
) -> None:
    """Plan ``module`` alone ([`group_calls`][fsdp_core.shard_calls.group_calls]: its
    groups, then itself) and run that plan."""
    calls = group_calls(module, groups, options)
    run_calls(module, calls, mesh=options.mesh, offload_policy=options.offload_policy)
