"""``ModelParallelizer``: decide the FSDP units of a model, then apply them.

Planning returns a [`ShardingPlan`][fsdp_core.plan.ShardingPlan] without side effects;
applying checks it once and makes its units with
[`shard_units`][fsdp_core.sharding.shard_units]. Model packages override the planning
hooks; [`apply_plan`][fsdp_core.parallelizer.apply_plan] needs nothing but the plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Generic, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_core import internals
from fsdp_core.accumulation import AccumulationWarmupRuntimeHook
from fsdp_core.collective_entry import enter_collective
from fsdp_core.containers import iter_layer_items
from fsdp_core.dtype_units import (
    UnitGroups,
    dtype_island_groups,
    find_dtype_islands,
    group_islands,
)
from fsdp_core.entry_unshard import EntryUnshardRuntimeHook
from fsdp_core.expert_parallel import expert_param_names
from fsdp_core.forward_agreement import ForwardAgreementRuntimeHook
from fsdp_core.hook_planning import core_hook_plans, forward_agreement_hook, is_entry
from fsdp_core.module_tree import (
    check_module_tree,
    install_first_forward_check,
    module_tree_fingerprint,
)
from fsdp_core.parallel_dims import ParallelDims
from fsdp_core.plan import ShardCall, ShardingPlan, UnitPlan
from fsdp_core.plan_context import FoundT, PlanAdditions, PlanContext
from fsdp_core.precision import island_policy
from fsdp_core.rank_wait import names_text
from fsdp_core.replica_grad import ReplicaGradReduceRuntimeHook
from fsdp_core.replicated import place_replicated_params
from fsdp_core.runtime import HookPlan, RuntimeHook, register_installed_hook
from fsdp_core.shard_calls import call_units, group_units
from fsdp_core.sharding import (
    ShardOptions,
    ShardTarget,
    check_ignored_params_supported,
    check_reshard_after_forward,
    is_sharded,
    shard_group_size,
    shard_targets,
    shard_units,
)
from fsdp_core.stale_optimizer import mark_replaced_parameters
from fsdp_core.unused_params import UnusedParamsRuntimeHook

__all__ = [
    "ModelParallelizer",
    "apply_plan",
    "PlanMismatchError",
    "check_applied_units",
    "parameter_names",
]

logger = logging.getLogger(__name__)


def parameter_names(model: nn.Module, params: Iterable[nn.Parameter] | None) -> tuple[str, ...]:
    """Qualified names of ``params`` in ``model``; a parameter it does not own is an error.

    Args:
        model: the model.
        params: parameters of it (None: none).

    Returns:
        Their qualified names, in the model's order.

    Raises:
        ValueError: a parameter is not ``model``'s.
    """
    wanted = set(params or ())
    named = [(name, p) for name, p in model.named_parameters() if p in wanted]
    missing = len(wanted - {p for _, p in named})
    if missing:
        raise ValueError(f"{missing} of the ignored_params are not parameters of the model")
    return tuple(name for name, _ in named)


class ModelParallelizer(Generic[FoundT]):
    """Shard each layer-container item as an FSDP unit, then the root.

    Units are dtype-safe ([`fsdp_core.dtype_units`][fsdp_core.dtype_units]) unless
    ``dtype_safe=False``. After sharding, the plan's runtime hooks
    ([`ShardingPlan.hooks`][fsdp_core.plan.ShardingPlan.hooks]) are installed, less
    ``disabled_hooks`` (names of [`HOOKS`][fsdp_core.parallelizer.ModelParallelizer.HOOKS]).
    ``FoundT`` is what the parallelizer finds in a model before planning (``ctx.found``).

    Args:
        dtype_safe: split odd-dtype islands into units of their own.
        disabled_hooks: runtime hooks not to plan.

    Raises:
        TypeError: ``dtype_safe`` is not a bool, or ``disabled_hooks`` not a list of names.
        ValueError: a hook name is unknown (the message lists the valid ones).
    """

    #: The runtime hook classes this parallelizer may plan; ``disabled_hooks`` takes their names.
    HOOKS: ClassVar[tuple[type[RuntimeHook], ...]] = (
        AccumulationWarmupRuntimeHook,
        UnusedParamsRuntimeHook,
        EntryUnshardRuntimeHook,
        ForwardAgreementRuntimeHook,
        ReplicaGradReduceRuntimeHook,
    )

    def __init__(self, *, dtype_safe: bool = True, disabled_hooks: Iterable[str] = ()) -> None:
        if not isinstance(dtype_safe, bool):
            raise TypeError(f"dtype_safe must be a bool, got {dtype_safe!r}")
        self.dtype_safe = dtype_safe
        self.disabled_hooks = _check_hook_names(disabled_hooks, self.HOOKS)

    # ----------------------------------------------------------------- public API
    def parallelize(
        self,
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        reshard_after_forward: bool | int | None = None,
        ignored_params: set[nn.Parameter] | None = None,
        dp_dims: str | Sequence[str] | None = None,
    ) -> nn.Module:
        """Plan and apply in one step, sharding ``model`` in place.

        ``mesh`` is the data-parallel mesh (1-D, or HSDP 2-D; ``world_mesh["dp"]`` after
        TP, CP, EP or PP), or the whole mesh with ``dp_dims`` naming its data-parallel
        dimensions (``"dp"``, ``("dp_replicate", "dp_shard")``; see
        [`ParallelDims`][fsdp_core.parallel_dims.ParallelDims]).

        Args:
            model: the model (real, or on ``meta``).
            mesh: the data-parallel mesh, or the whole mesh with ``dp_dims``.
            mp_policy: the mixed-precision policy (None: ``MixedPrecisionPolicy()``, no casts).
            offload_policy: FSDP2's offload policy for every unit.
            reshard_after_forward: as ``fully_shard`` takes it.
            ignored_params: parameters FSDP leaves alone.
            dp_dims: the data-parallel dimensions of ``mesh``.

        Returns:
            ``model``, sharded.

        Raises:
            TypeError: ``mesh`` is not a ``DeviceMesh``.
            ValueError: ``dp_dims`` names no dimension of ``mesh``, or ``mesh`` alone is
                not a data-parallel mesh (see ``ParallelDims.from_mesh``).
        """
        dims = ParallelDims.from_mesh(mesh, dp_dims=dp_dims)
        check_reshard_after_forward(reshard_after_forward, shard_group_size(dims.dp_mesh))
        plan = self.plan(
            model,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
        )
        return _apply(model, plan, dims=dims, offload_policy=offload_policy, parallelizer=self)

    def plan(
        self,
        model: nn.Module,
        *,
        mp_policy: MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool | int | None = None,
        ignored_params: set[nn.Parameter] | None = None,
    ) -> ShardingPlan:
        """Decide the units without touching the model or needing a process group.

        Args:
            model: the model (on ``meta`` is enough).
            mp_policy: the mixed-precision policy (None: ``MixedPrecisionPolicy()``, no casts).
            reshard_after_forward: as ``fully_shard`` takes it.
            ignored_params: parameters FSDP leaves alone.

        Returns:
            The plan.
        """
        return self._plan(
            model,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
            found=None,
        )

    def _plan(
        self,
        model: nn.Module,
        *,
        mp_policy: MixedPrecisionPolicy | None,
        reshard_after_forward: bool | int | None,
        ignored_params: set[nn.Parameter] | None,
        found: FoundT | None,
    ) -> ShardingPlan:
        """The one planning pass: what ``_find`` finds (unless ``found``), the replicated
        and ignored parameters, the calls, the additions, then the runtime hooks."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(
                f"mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}"
            )
        check_reshard_after_forward(reshard_after_forward, shard_size=None)  # mesh-free
        given = (*parameter_names(model, ignored_params), *expert_param_names(model))
        ctx: PlanContext[FoundT] = PlanContext(
            model=model,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
            ignored_param_names=frozenset(),
            found=self._find(model) if found is None else found,
        )
        ctx.replicated_param_names = tuple(sorted(set(self._replicated_param_names(ctx))))
        ctx.ignored_param_names = frozenset(
            (*self._ignored_param_names(model, given), *ctx.replicated_param_names)
        )
        calls: list[ShardCall] = []
        for unit in self._units(ctx):
            if isinstance(unit, ShardCall):
                calls.append(unit)
            elif not ctx.is_planned(ctx.module(unit)) and ctx.has_unplanned_params(unit):
                calls.extend(self._plan_calls(unit, ctx))
        calls.extend(self._plan_calls("", ctx))
        added = self._plan_additions(ctx, tuple(calls))  # fields named as the plan's
        plan = ShardingPlan(
            calls=tuple(calls),
            ignored_param_names=tuple(sorted(ctx.ignored_param_names)),
            notes=tuple(self._plan_notes(ctx)),
            replicated_param_names=ctx.replicated_param_names,
            fingerprint=module_tree_fingerprint(model),
            **vars(added),
        )
        planned = [*self._plan_hooks(ctx, plan), forward_agreement_hook()]
        hooks = [h for h in planned if h.name not in self.disabled_hooks]
        return dataclasses.replace(plan, hooks=tuple(hooks))

    def apply_plan(
        self,
        model: nn.Module,
        plan: ShardingPlan,
        *,
        mesh: DeviceMesh,
        offload_policy: OffloadPolicy | None = None,
        dp_dims: str | Sequence[str] | None = None,
    ) -> nn.Module:
        """Shard ``model`` in place as ``plan`` says:
        [`apply_plan`][fsdp_core.parallelizer.apply_plan] with this parallelizer's
        ``_before_apply`` and ``_after_apply``, installing only hooks of its ``HOOKS``. A
        transformers or peft model then gets a collective ``save_pretrained``.

        Args:
            model: the planned model.
            plan: what ``plan`` returned.
            mesh: the data-parallel mesh, or the whole mesh with ``dp_dims``.
            offload_policy: FSDP2's offload policy for every unit.
            dp_dims: the data-parallel dimensions of ``mesh``.

        Returns:
            ``model``, sharded.
        """
        dims = ParallelDims.from_mesh(mesh, dp_dims=dp_dims)
        return _apply(model, plan, dims=dims, offload_policy=offload_policy, parallelizer=self)

    # ------------------------------------------------------------ hooks to override
    def _fully_shard_module(self, module: ShardTarget, **kwargs: object) -> ShardTarget:
        """Plan ``module`` alone and apply that plan (the reference contract's entry for
        frameworks that decide the units themselves; ``apply_plan`` does not call it).

        ``mesh=`` and ``mp_policy=`` are required; the other options default to ``None``.
        The units [`_unit_groups`][fsdp_core.parallelizer.ModelParallelizer._unit_groups]
        names come first, then ``module``. A list of modules is one grouped unit; a module
        that already is a unit is left as it is.

        Args:
            module: a module, or the modules of one grouped unit.
            **kwargs: ``mesh``, ``mp_policy`` and the optional sharding options.

        Returns:
            ``module``.

        Raises:
            TypeError: an unknown or missing option, or one of the wrong type.
            ValueError: ``reshard_after_forward`` does not divide the shard group.
        """
        options = ShardOptions.from_kwargs(
            kwargs, caller=f"{type(self).__name__}._fully_shard_module"
        )
        members = shard_targets(module)
        if len(members) > 1:
            shard_units([(members, options)])
        elif is_sharded(members[0]):
            logger.info("%s is already an FSDP unit; leaving it as it is", type(module).__name__)
        else:
            groups = self._unit_groups(members[0], options)
            shard_units(group_units(members[0], groups, options))
        return module

    def _unit_groups(self, module: nn.Module, options: ShardOptions) -> UnitGroups:
        """The units made inside ``module`` before it, outside a plan (paths relative to
        ``module``): its dtype islands unless ``dtype_safe=False``; model packages add theirs."""
        if not self.dtype_safe:
            return []
        return dtype_island_groups(module, options.mp_policy, ignored_params=options.ignored_params)

    def _units(self, ctx: PlanContext[FoundT]) -> list[str | ShardCall]:
        """The units made before the root, in order: a path becomes a unit by
        [`_plan_calls`][fsdp_core.parallelizer.ModelParallelizer._plan_calls] (unless planned
        or without parameters), a ``ShardCall`` is kept as is. Here: the layer-container items."""
        return [path for path, _ in iter_layer_items(ctx.model)]

    def _find(self, model: nn.Module) -> FoundT:
        """What the planning hooks read as ``ctx.found``, found once per plan (a multimodal
        parallelizer's discovery); ``None`` here."""
        return cast(FoundT, None)

    def _ignored_param_names(self, model: nn.Module, names: tuple[str, ...]) -> Iterable[str]:
        """Parameters kept out of FSDP besides the replicated ones (``names``: the caller's)."""
        return names

    def _replicated_param_names(self, ctx: PlanContext[FoundT]) -> Iterable[str]:
        """Parameters kept whole on every rank (placed before sharding, in no unit); none here."""
        return ()

    def _plan_additions(
        self, ctx: PlanContext[FoundT], calls: tuple[ShardCall, ...]
    ) -> PlanAdditions:
        """What the plan holds beside its calls (``PlanAdditions``); nothing here."""
        return PlanAdditions()

    def _plan_notes(self, ctx: PlanContext[FoundT]) -> list[str]:
        return []

    def _entry_paths(self, ctx: PlanContext[FoundT]) -> list[str]:
        """Modules called outside the model's forward, whose units ``entry_unshard`` gathers
        (see ``hook_planning.is_entry``); the multimodal parallelizer adds towers and projectors."""
        return [path for path, module in ctx.model.named_modules() if path and is_entry(module)]

    def _plan_hooks(self, ctx: PlanContext[FoundT], plan: ShardingPlan) -> list[HookPlan]:
        """The runtime hooks the finished ``plan`` needs, ``disabled_hooks`` included."""
        return core_hook_plans(
            ctx.model, plan, self._entry_paths(ctx), self._shared_params(ctx, plan)
        )

    def _shared_params(self, ctx: PlanContext[FoundT], plan: ShardingPlan) -> list[str]:
        """Trainable parameters whose inputs a data group's ranks split (gradients summed
        over it, ``fsdp_core.replica_grad``); none here."""
        return []

    def _before_apply(self, model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> None:
        """Runs once before the first unit is made, after the replicated parameters are placed."""

    def _after_apply(self, model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> None:
        """Runs once after the last unit is made (e.g. to tune prefetching or add guards)."""

    def _plan_calls(self, path: str, ctx: PlanContext[FoundT]) -> list[ShardCall]:
        """The calls that make ``path`` a unit: its dtype islands first, then itself."""
        reshard = ctx.reshard_after_forward
        groups: list[tuple[tuple[str, ...], MixedPrecisionPolicy, str]] = []
        if self.dtype_safe:
            dominant, islands = find_dtype_islands(
                ctx.module(path),
                prefix=path,
                skip=lambda _p, sub: ctx.is_planned(sub),
                ignored_param_names=ctx.ignored_param_names,
            )
            for dtype, paths in group_islands(islands):
                policy = island_policy(dtype, ctx.mp_policy, surrounding_dtype=dominant)
                groups.append((paths, policy, "dtype_island"))
        groups.append(((path,), ctx.mp_policy, "root" if path == "" else "layer"))
        return [
            self._make_call(paths, ctx, mp_policy=policy, reshard_after_forward=reshard, role=role)
            for paths, policy, role in groups
        ]

    # ------------------------------------------------------------------- helpers
    def _make_call(
        self,
        paths: tuple[str, ...],
        ctx: PlanContext[FoundT],
        *,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | int | None,
        role: str,
        units: tuple[UnitPlan, ...] | None = None,
    ) -> ShardCall:
        """A call with one unit (or the given ``units``), marking its members as planned."""
        ignored = ctx.ignored_under(paths)
        offload = self._unit_offload(paths, ctx)
        if units is None:
            units = (UnitPlan(paths, mp_policy, reshard_after_forward, ignored, role, offload),)
        for unit in units:
            ctx.mark(unit.paths)
        ctx.mark(paths)
        return ShardCall(paths, mp_policy, reshard_after_forward, ignored, units, offload)

    def _unit_offload(
        self, paths: tuple[str, ...], ctx: PlanContext[FoundT]
    ) -> OffloadPolicy | None:
        """The offload policy the plan gives the unit of ``paths``; ``None`` here (the
        device, or ``apply_plan(offload_policy=...)``)."""
        return None


class PlanMismatchError(RuntimeError):
    """Applying a plan made other FSDP units than the plan lists."""


def check_applied_units(model: nn.Module, plan: ShardingPlan) -> None:
    """Raise [`PlanMismatchError`][fsdp_core.parallelizer.PlanMismatchError] unless the FSDP units
    in ``model`` are exactly ``plan.units`` (a warning where torch's FSDP state is unreadable).

    Args:
        model: the sharded model.
        plan: its plan.

    Raises:
        PlanMismatchError: naming the units missing and the units not planned.
    """
    try:
        applied = internals.applied_unit_paths(model)
    except internals.FSDPInternalsError as exc:
        logger.warning("cannot compare the applied units with the plan: %s", exc)
        return
    planned = {tuple(sorted(unit.paths)) for unit in plan.units}
    made = {tuple(sorted(paths)) for paths in applied}
    if planned == made:
        return
    raise PlanMismatchError(
        f"applying the plan made {len(made)} FSDP units where the plan lists {len(planned)}: "
        f"made but not planned {_paths_text(sorted(made - planned))}; planned but not made "
        f"{_paths_text(sorted(planned - made))}. Plan every unit (override the planning "
        "hooks, e.g. _units or _plan_calls), so that applying the plan makes only those."
    )


def apply_plan(
    model: nn.Module,
    plan: ShardingPlan,
    *,
    mesh: DeviceMesh,
    offload_policy: OffloadPolicy | None = None,
    dp_dims: str | Sequence[str] | None = None,
) -> nn.Module:
    """Shard ``model`` in place from the plan alone: place the replicated parameters,
    make each planned unit, check them and install the planned runtime hooks. Collective
    over the ranks that run the forward together; ``mesh`` and ``dp_dims`` as in
    [`ModelParallelizer.parallelize`][fsdp_core.parallelizer.ModelParallelizer.parallelize].

    Args:
        model: the planned model.
        plan: the plan.
        mesh: the data-parallel mesh, or the whole mesh with ``dp_dims``.
        offload_policy: FSDP2's offload policy for every unit.
        dp_dims: the data-parallel dimensions of ``mesh``.

    Returns:
        ``model``, sharded.

    Raises:
        TypeError: ``plan`` is not a ``ShardingPlan``, or ``mesh`` not a ``DeviceMesh``.
        ValueError: the plan cannot be applied as given (an offload for every unit beside
            per-unit ones, options the mesh refuses, a hook without its object).
        PlanMismatchError: ranks hold different plans, or the units made differ from it.
    """
    dims = ParallelDims.from_mesh(mesh, dp_dims=dp_dims)
    return _apply(model, plan, dims=dims, offload_policy=offload_policy, parallelizer=None)


def _apply(
    model: nn.Module,
    plan: ShardingPlan,
    *,
    dims: ParallelDims,
    offload_policy: OffloadPolicy | None,
    parallelizer: ModelParallelizer[Any] | None,
) -> nn.Module:
    """The one application of a plan: every check first, then the units, then the hooks."""
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    # Every rank that runs the model's forward (dp, TP, CP, EP) applies the same plan.
    entry = enter_collective("apply_plan", ranks=dims.lockstep_ranks())
    mesh = dims.dp_mesh
    entry.agree_on(_plan_digest(plan), what="sharding plan", error=PlanMismatchError)
    if plan.fingerprint is not None:
        check_module_tree(model, plan.fingerprint)
    check_ignored_params_supported(plan.ignored_param_names, plan.replicated_param_names)
    units = call_units(model, plan.calls, mesh=mesh, offload_policy=offload_policy)
    hooks = [_hook_object(planned, parallelizer) for planned in plan.hooks]
    named = dict(model.named_parameters())
    place_replicated_params(model, plan, mesh=dims.lockstep_mesh)
    if parallelizer is not None:
        parallelizer._before_apply(model, plan, mesh=mesh)
    shard_units(units)
    if parallelizer is not None:
        parallelizer._after_apply(model, plan, mesh=mesh)
    mark_replaced_parameters(model, named)
    check_applied_units(model, plan)
    internals.check_internals(model, {hook.name: hook.reads for hook in hooks})
    for hook in hooks:
        installed = hook.install(model, dims=dims)
        if installed is not None:
            register_installed_hook(model, installed)
    install_first_forward_check(model, module_tree_fingerprint(model))
    # Imported here so that ``import fsdp_core`` does not load the checkpoint I/O.
    from fsdp_core.hf._hf_methods import install_collective_save

    install_collective_save(model)
    logger.info(
        "applied %d FSDP units in %d calls; runtime hooks: %s",
        len(plan.units),
        len(plan.calls),
        ", ".join(plan.hook_names()) or "none",
    )
    return model


def _paths_text(units: list[tuple[str, ...]]) -> str:
    return names_text(units, 4, show=lambda paths: str([p or "<root>" for p in paths])) or "none"


def _check_hook_names(names: Iterable[str], hooks: Iterable[type[RuntimeHook]]) -> frozenset[str]:
    known = tuple(hook.name for hook in hooks)
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(
            f"disabled_hooks must be a collection of hook names, got {type(names).__name__} "
            f"({names!r}); valid names: {', '.join(known)}"
        )
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"disabled_hooks entries must be str, got {type(name).__name__}")
        if name not in known:
            raise ValueError(f"unknown runtime hook {name!r}; valid names: {', '.join(known)}")
    return frozenset(names)


def _plan_digest(plan: ShardingPlan) -> str:
    """A hash of what applying ``plan`` does, the same on every rank that holds the same
    plan: ranks that differ in any of it would meet in different collectives."""
    text = repr(
        (
            plan.calls,
            plan.ignored_param_names,
            plan.replicated_param_names,
            plan.replicated_param_dtypes,
            plan.sync_replicated,
            plan.hook_names(),
        )
    )
    return hashlib.sha256(re.sub(r" at 0x[0-9a-f]+", "", text).encode()).hexdigest()


def _hook_object(planned: HookPlan, parallelizer: ModelParallelizer[Any] | None) -> RuntimeHook:
    """The hook object of a planned hook; with a parallelizer, one of its ``HOOKS``."""
    hook = planned.hook
    if hook is None:
        raise ValueError(
            f"the plan lists a runtime hook {planned.name!r} without its hook object; "
            "plans made by a parallelizer's plan() carry it"
        )
    if parallelizer is not None and not isinstance(hook, parallelizer.HOOKS):
        raise ValueError(
            f"{type(parallelizer).__name__} cannot install a runtime hook named "
            f"{planned.name!r}; it installs {', '.join(h.name for h in parallelizer.HOOKS)}"
        )
    return hook
