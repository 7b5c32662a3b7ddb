"""Each unit of a plan in the step it is costed for: the byte rules, what the unit stores
and gathers, and the collectives it issues.

[`plan_costs`][multimodal_fsdp.estimate.costs.plan_costs] resolves the plan on its mesh
once (``resolve_step``): which module paths no gradient reaches, where each module sits
in the forward, which parameters each unit owns, and the
[`HookStep`][fsdp_core.runtime.HookStep] every runtime hook's cost model reads. Each unit
is then placed in that step (``place_unit``): whether its backward runs, what it gathers
and stores, and the collectives it issues as often as the hooks say it runs.

The byte rules live here, in one place, for every estimate (collectives, activation
replay, memory): each collective moves the unsharded buffer, with FSDP's padding of every
parameter's dim 0 to a multiple of the shard-group size, in the dtype on the wire (the
compute dtype for all-gathers, the reduce dtype for reduce-scatters), as
[`CommCounter`][fsdp_core.collective_count.CommCounter] counts it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core import ShardingPlan
from fsdp_core.collective_count import CommTally
from fsdp_core.containers import is_under, module_spans
from fsdp_core.mesh import MeshShape
from fsdp_core.parallel_dims import ParallelDims, local_shape
from fsdp_core.plan import UnitPlan, unit_parameters
from fsdp_core.precision import compute_dtype
from fsdp_core.runtime import HookStep
from fsdp_core.sharding import check_reshard_after_forward
from multimodal_fsdp.estimate.exchange import StepMedia
from multimodal_fsdp.estimate.timeline import _Unit, effective_reshard
from multimodal_fsdp.reachability import backward_free_paths

__all__ = [
    "CostedStep",
    "padded_shard_numel",
    "param_compute_dtype",
    "param_reduce_dtype",
    "place_unit",
    "resolve_step",
    "unit_reduce_dtype",
]


def _dim0_padded_numel(shape: torch.Size, factor: int) -> int:
    """Elements after FSDP pads dim 0 to a multiple of ``factor``; FSDP2 refuses scalar
    (0-d) parameters, so they have none."""
    if not shape:
        raise ValueError(
            "fully_shard does not support scalar parameters; make them 1-D (numel 1) or ignore them"
        )
    rows = math.ceil(shape[0] / factor) * factor
    return rows * math.prod(shape[1:])


def padded_shard_numel(param: nn.Parameter, shard: int) -> int:
    """Elements of one rank's shard after FSDP pads dim 0 to a multiple of ``shard`` (the
    one padding rule of the estimates: collectives, activation replay, memory)."""
    return _dim0_padded_numel(local_shape(param), shard) // shard


def param_compute_dtype(param: nn.Parameter, policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param`` is gathered and computes in: the policy's ``param_dtype`` for a
    floating parameter, else its own (the one dtype rule of the estimates)."""
    if param.dtype.is_floating_point:
        return compute_dtype(policy, param.dtype)
    return param.dtype


def param_reduce_dtype(param: nn.Parameter, policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param``'s gradient is reduced in: ``reduce_dtype``, else its compute dtype."""
    if policy.reduce_dtype is not None:
        return policy.reduce_dtype
    return param_compute_dtype(param, policy)


def unit_reduce_dtype(
    params: list[tuple[str, nn.Parameter]], policy: MixedPrecisionPolicy
) -> torch.dtype:
    """The reduce dtype of a unit: that of its first trainable (else first) parameter."""
    trainable = [p for _, p in params if p.requires_grad] or [p for _, p in params]
    if not trainable:
        return policy.reduce_dtype or policy.param_dtype or torch.float32
    return param_reduce_dtype(trainable[0], policy)


def _gathered_bytes(
    params: list[tuple[str, nn.Parameter]], policy: MixedPrecisionPolicy, shard: int
) -> int:
    """All-gather output bytes: every parameter padded, in its compute dtype."""
    return sum(
        _dim0_padded_numel(local_shape(p), shard) * param_compute_dtype(p, policy).itemsize
        for _, p in params
    )


def _sharded_bytes(params: list[tuple[str, nn.Parameter]], shard: int) -> int:
    """Bytes one rank stores: its padded shard of each parameter, in the storage dtype."""
    return sum(
        _dim0_padded_numel(local_shape(p), shard) // shard * p.dtype.itemsize for _, p in params
    )


def _unit_collectives(
    params: list[tuple[str, nn.Parameter]],
    policy: MixedPrecisionPolicy,
    *,
    gathered: int,
    reshard: bool | int,
    runs_backward: bool,
    shard: int,
    replicate: int,
) -> CommTally:
    """The collectives one unit issues in a step (see
    [`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs])."""
    tally = CommTally()
    if not params:
        return tally
    if shard > 1:
        tally.add("forward", "all_gather", gathered)
        if reshard is not False and runs_backward:
            tally.add("backward", "all_gather", gathered)
    trainable = [p for _, p in params if p.requires_grad]
    if not trainable:
        return tally
    reduce = unit_reduce_dtype(params, policy)
    padded = sum(_dim0_padded_numel(local_shape(p), shard) for p in trainable)
    if shard > 1:
        tally.add("backward", "reduce_scatter", padded * reduce.itemsize)
    if replicate > 1:
        tally.add("backward", "all_reduce", padded // shard * reduce.itemsize)
    return tally


@dataclass(frozen=True)
class CostedStep:
    """The plan on its mesh as every unit's and hook's tally reads it: resolved once, so
    each tally is a function of the step alone and ``plan_costs`` a loop over them."""

    #: What the hooks' cost models read: plan, model, mesh shape, units' parameters, media.
    hook: HookStep
    #: Module paths no gradient reaches, and whether they are a judgement to report
    #: (the planner's or the default discovery's, not the caller's ``no_backward``).
    free: list[str]
    free_judged: bool
    forced: tuple[str, ...]
    spans: dict[str, tuple[int, int]]
    any_trainable: bool
    #: Per unit, its ``(name, parameter)`` pairs (the same lists ``hook.owned`` holds).
    owned: list[list[tuple[str, nn.Parameter]]]

    @property
    def plan(self) -> ShardingPlan:
        return self.hook.plan

    @property
    def model(self) -> nn.Module:
        return self.hook.model

    @property
    def shape(self) -> MeshShape:
        return self.hook.mesh

    @property
    def media(self) -> StepMedia | None:
        media = self.hook.media
        return media if isinstance(media, StepMedia) else None


def resolve_step(
    plan: ShardingPlan,
    model: nn.Module,
    shape: MeshShape,
    no_backward: Iterable[str] | None,
    with_backward: Iterable[str],
    media: StepMedia | None,
    *,
    parallel: ParallelDims | None = None,
) -> CostedStep:
    """Check the plan against the mesh and read, once, what the tallies share; the
    checks run in the order users have always seen their errors."""
    for unit in plan.units:
        check_reshard_after_forward(unit.reshard_after_forward, shape.dp_shard)
    if no_backward is not None:
        free = list(no_backward)
    elif plan.backward_free_paths is not None:  # the planner's judgement
        free = list(plan.backward_free_paths)
    else:
        free = backward_free_paths(model)
    forced = tuple(with_backward)
    spans = module_spans(model)
    any_trainable = any(p.requires_grad for p in model.parameters())
    owned = unit_parameters(plan, model)
    if media is not None and not isinstance(media, StepMedia):
        raise TypeError(f"media must be a StepMedia, got {type(media).__name__}")
    return CostedStep(
        hook=HookStep(
            plan=plan, model=model, mesh=shape, owned=owned, media=media, parallel=parallel
        ),
        free=free,
        free_judged=no_backward is None,
        forced=forced,
        spans=spans,
        any_trainable=any_trainable,
        owned=owned,
    )


def place_unit(
    unit: UnitPlan,
    params: list[tuple[str, nn.Parameter]],
    step: CostedStep,
    runs: Mapping[str, int],
) -> _Unit:
    """One unit where it runs in the step, with the collectives it issues there (``runs``:
    how often the units under a module path run, as the hooks say): the timeline of
    gathered parameters and the prefetch waste are computed from these."""
    scalars = [name for name, p in params if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"unit {unit.label}: fully_shard does not support scalar parameters "
            f"{scalars}; make them 1-D (numel 1) or ignore them"
        )
    missing = [p for p in unit.paths if p not in step.spans]
    if missing:
        raise ValueError(f"unit {unit.label}: no module at {missing} in the model")
    shard = step.shape.dp_shard
    runs_backward = _runs_backward(unit, params, step)
    reshard = effective_reshard(unit, shard)
    gathered = _gathered_bytes(params, unit.mp_policy, shard)
    collectives = _unit_collectives(
        params,
        unit.mp_policy,
        gathered=gathered,
        reshard=reshard,
        runs_backward=runs_backward,
        shard=shard,
        replicate=step.shape.dp_replicate,
    )
    repeated = CommTally()
    repeated.merge(collectives, _unit_runs(unit, runs))
    return _Unit(
        plan=unit,
        params=params,
        start=min(step.spans[p][0] for p in unit.paths),
        end=max(step.spans[p][1] for p in unit.paths),
        reshard=reshard,
        runs_backward=runs_backward,
        gathered=gathered,
        sharded=_sharded_bytes(params, shard),
        comm=repeated,
    )


def _runs_backward(
    unit: UnitPlan, params: list[tuple[str, nn.Parameter]], step: CostedStep
) -> bool:
    """Whether the unit's backward runs: a frozen unit that no gradient reaches skips it
    (and its re-gather), unless the caller forces it; the root always runs one."""
    trainable = any(p.requires_grad for _, p in params)
    gradient_free = not trainable and all(
        any(is_under(p, root) for root in step.free) for p in unit.paths
    )
    if any(is_under(p, root) for p in unit.paths for root in step.forced):
        gradient_free = False
    return step.any_trainable and (unit.is_root or not gradient_free)


def _unit_runs(unit: UnitPlan, runs: Mapping[str, int]) -> int:
    """How often a non-root unit inside a module the hooks repeat (a balanced or joined
    one) runs in the step (1 elsewhere)."""
    if unit.is_root:
        return 1
    for path, count in runs.items():
        if all(is_under(member, path) for member in unit.paths):
            return count
    return 1
