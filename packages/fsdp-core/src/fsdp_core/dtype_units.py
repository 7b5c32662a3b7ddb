"""Dtype-safe FSDP units.

FSDP2 requires every trainable parameter of a unit to have the same dtype and
only says so at the first forward (``AssertionError: FSDP expects uniform
original parameter dtype``). This module finds mixed modules before sharding,
splits the odd-dtype submodules ("islands", e.g. fp32 norms in a bf16 model)
into units of their own, and names the parameters when a split is impossible.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_core import compat
from fsdp_core.containers import join_path
from fsdp_core.precision import island_policy
from fsdp_core.shard_calls import group_units
from fsdp_core.sharding import ShardOptions, is_sharded, shard_units

__all__ = [
    "DtypeIsland",
    "MixedDtypeError",
    "dominant_dtype",
    "find_dtype_islands",
    "group_islands",
    "UnitGroups",
    "dtype_island_groups",
    "fully_shard_dtype_safe",
    "shard_groups_then_module",
]

#: Decides whether a submodule is already a unit of its own (its parameters leave this one).
SkipPredicate = Callable[[str, nn.Module], bool]


class MixedDtypeError(ValueError):
    """A module holds parameters of several dtypes directly, so no split can separate them."""


@dataclass(frozen=True)
class DtypeIsland:
    """A maximal submodule whose considered parameters share one non-dominant dtype."""

    path: str
    dtype: torch.dtype


def dominant_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The dtype holding the most elements of ``tensors`` (first seen wins a tie).

    Args:
        tensors: parameters or any tensors.

    Returns:
        The dtype with the most elements, or None.
    """
    counts: Counter[torch.dtype] = Counter()
    for tensor in tensors:
        counts[tensor.dtype] += tensor.numel()
    if not counts:
        return None
    return max(counts, key=lambda dtype: counts[dtype])


def find_dtype_islands(
    module: nn.Module,
    *,
    prefix: str = "",
    trainable_only: bool = True,
    skip: SkipPredicate | None = None,
    ignored_param_names: Iterable[str] = (),
) -> tuple[torch.dtype | None, tuple[DtypeIsland, ...]]:
    """The dominant dtype of ``module``'s unit and the islands to split off.

    Only trainable parameters count by default, as in FSDP's rule (frozen ones may mix).

    Args:
        module: the module that becomes one unit.
        prefix: its qualified name, for the islands' paths.
        trainable_only: count only trainable parameters (FSDP's rule).
        skip: submodules to leave out (already units, replicated, ...).
        ignored_param_names: names of parameters FSDP ignores.

    Returns:
        The unit's dominant dtype and its islands.

    Raises:
        MixedDtypeError: a module holds parameters of another dtype directly (no split helps).
    """
    ignored = frozenset(ignored_param_names)

    def children(sub: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
        named = ((join_path(path, name), child) for name, child in sub.named_children())
        return [(p, child) for p, child in named if skip is None or not skip(p, child)]

    def own(sub: nn.Module, path: str) -> list[tuple[str, nn.Parameter]]:
        params = sub.named_parameters(prefix=path, recurse=False)
        return [
            (n, p)
            for n, p in params
            if n not in ignored and (p.requires_grad or not trainable_only)
        ]

    def considered(sub: nn.Module, path: str) -> list[nn.Parameter]:
        """The parameters that will land in ``sub``'s unit."""
        found = [p for _, p in own(sub, path)]
        for child_path, child in children(sub, path):
            found += considered(child, child_path)
        return found

    dominant = dominant_dtype(considered(module, prefix))
    if dominant is None:
        return None, ()
    islands: list[DtypeIsland] = []
    offenders: list[str] = []

    def visit(sub: nn.Module, path: str) -> None:
        offenders.extend(
            f"{n or '<param>'} ({p.dtype})" for n, p in own(sub, path) if p.dtype != dominant
        )
        for child_path, child in children(sub, path):
            dtypes = {p.dtype for p in considered(child, child_path)}
            if not dtypes or dtypes == {dominant}:
                continue
            if len(dtypes) == 1:
                islands.append(DtypeIsland(child_path, dtypes.pop()))
            else:
                visit(child, child_path)

    visit(module, prefix)
    if offenders:
        where = prefix or type(module).__name__
        raise MixedDtypeError(
            f"cannot make dtype-safe FSDP units for {where!r}: parameters "
            f"{', '.join(offenders)} are held directly next to {dominant} parameters. "
            "Move them into a submodule, cast them to one dtype, or freeze them "
            "(FSDP only requires uniform dtypes among trainable parameters)."
        )
    return dominant, tuple(islands)


def group_islands(
    islands: Iterable[DtypeIsland], *, grouped: bool | None = None
) -> list[tuple[torch.dtype, tuple[str, ...]]]:
    """Islands bundled into units: one per dtype when torch can cast per module in a
    group, else one per island (each tiny unit costs an all-gather and a reduce-scatter).

    Args:
        islands: the islands found.
        grouped: whether modules may share one unit (None: what this torch supports).

    Returns:
        ``(dtype, island paths)`` per unit to make.

    Raises:
        ValueError: ``grouped=True`` where this torch cannot cast per module in a group.
    """
    can_group = compat.GROUPED_PER_MODULE_CASTING if grouped is None else grouped
    if grouped and not compat.GROUPED_PER_MODULE_CASTING:
        raise ValueError(
            f"this torch ({torch.__version__}) cannot cast per module inside a grouped unit; "
            "pass grouped=False"
        )
    if not can_group:
        return [(island.dtype, (island.path,)) for island in islands]
    by_dtype: dict[torch.dtype, list[str]] = {}
    for island in islands:
        by_dtype.setdefault(island.dtype, []).append(island.path)
    return [(dtype, tuple(paths)) for dtype, paths in by_dtype.items()]


def shard_groups_then_module(
    module: nn.Module,
    groups: Sequence[tuple[Sequence[str], MixedPrecisionPolicy]],
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Make each group of submodules (paths under ``module``) a unit with its own
    policy, then ``module`` itself a unit with ``mp_policy``: the order that keeps
    the groups' parameters out of the parent unit.

    Args:
        module: the module that becomes the outer unit.
        groups: ``(submodule paths, policy)`` per inner unit.
        mesh: the data-parallel mesh.
        mp_policy: the outer unit's policy.
        offload_policy: FSDP2's offload policy for every unit made.
        reshard_after_forward: as ``fully_shard`` takes it.
        ignored_params: parameters FSDP leaves alone.
    """
    ignored = frozenset(ignored_params or ())
    options = ShardOptions(mesh, mp_policy, offload_policy, reshard_after_forward, ignored)
    shard_units(group_units(module, groups, options))


#: Units to make inside a module before the module itself: member paths (relative to
#: the module) and the policy of each.
UnitGroups = list[tuple[tuple[str, ...], MixedPrecisionPolicy]]


def dtype_island_groups(
    module: nn.Module,
    mp_policy: MixedPrecisionPolicy,
    *,
    ignored_params: Iterable[nn.Parameter] | None = None,
    skip: SkipPredicate | None = None,
    grouped: bool | None = None,
) -> UnitGroups:
    """The island units that make ``module`` one dtype-safe unit: its odd-dtype submodules
    (not already sharded, not ``skip``ped), grouped as torch allows, each with
    [`island_policy`][fsdp_core.precision.island_policy].

    Args:
        module: the module that becomes one unit.
        mp_policy: the policy of the surrounding unit.
        ignored_params: parameters FSDP leaves alone.
        skip: submodules to leave out.
        grouped: as for [`group_islands`][fsdp_core.dtype_units.group_islands].

    Returns:
        The island groups, each with its policy.
    """
    wanted = set(ignored_params or ())
    ignored_names = {name for name, p in module.named_parameters() if p in wanted}

    dominant, islands = find_dtype_islands(
        module,
        skip=lambda path, sub: is_sharded(sub) or (skip is not None and skip(path, sub)),
        ignored_param_names=ignored_names,
    )
    return [
        (paths, island_policy(dtype, mp_policy, surrounding_dtype=dominant))
        for dtype, paths in group_islands(islands, grouped=grouped)
    ]


def fully_shard_dtype_safe(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    grouped: bool | None = None,
) -> nn.Module:
    """Shard ``module`` as one unit after splitting off its odd-dtype islands.

    Islands get [`fsdp_core.precision.island_policy`][fsdp_core.precision.island_policy] (their own
    dtype for params and reduction, output cast to the surrounding compute dtype).

    Args:
        module: the module to shard.
        mesh: the data-parallel mesh.
        mp_policy: the module's policy.
        offload_policy: FSDP2's offload policy.
        reshard_after_forward: as ``fully_shard`` takes it.
        ignored_params: parameters FSDP leaves alone.
        grouped: as for [`group_islands`][fsdp_core.dtype_units.group_islands].

    Returns:
        ``module``, sharded.
    """
    ignored = frozenset(ignored_params or ())
    options = ShardOptions(mesh, mp_policy, offload_policy, reshard_after_forward, ignored)
    groups = dtype_island_groups(module, mp_policy, ignored_params=ignored_params, grouped=grouped)
    shard_units(group_units(module, groups, options))
    return module
