"""Each unit of a plan in the step it is costed for, and the byte rules of every estimate.

[`plan_costs`][multimodal_fsdp.estimate.costs.plan_costs] resolves the plan on its mesh
once (``resolve_step``), then places each unit in that step (``place_unit``): whether its
backward runs, what it gathers and stores, and its collectives. Each collective moves the
unsharded buffer, every parameter's dim 0 padded to a multiple of the shard-group size, in
the dtype on the wire (compute dtype for all-gathers, reduce dtype for reduce-scatters), as
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


def padded_shard_numel(param: nn.Parameter, shard: int) -> int:
    """The padding rule of every estimate.

    Args:
        param: A parameter (a DTensor counts by its local shard).
        shard: The shard-group size.

    Returns:
        Elements of one rank's shard after FSDP pads dim 0 to a multiple of ``shard``.

    Raises:
        ValueError: ``param`` is a scalar (FSDP2 refuses them).
    """
    shape = local_shape(param)
    if not shape:
        raise ValueError(
            "fully_shard does not support scalar parameters; make them 1-D (numel 1) or ignore them"
        )
    return math.ceil(shape[0] / shard) * math.prod(shape[1:])


def param_compute_dtype(param: nn.Parameter, policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype rule of every estimate.

    Args:
        param: A parameter.
        policy: Its unit's mixed-precision policy.

    Returns:
        The dtype ``param`` is gathered and computes in: the policy's ``param_dtype`` for
        a floating parameter, else its own.
    """
    if param.dtype.is_floating_point:
        return compute_dtype(policy, param.dtype)
    return param.dtype


def param_reduce_dtype(param: nn.Parameter, policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype ``param``'s gradient is reduced in.

    Args:
        param: A parameter.
        policy: Its unit's mixed-precision policy.

    Returns:
        The policy's ``reduce_dtype``, else ``param``'s compute dtype.
    """
    if policy.reduce_dtype is not None:
        return policy.reduce_dtype
    return param_compute_dtype(param, policy)


def unit_reduce_dtype(
    params: list[tuple[str, nn.Parameter]], policy: MixedPrecisionPolicy
) -> torch.dtype:
    """The reduce dtype of a unit.

    Args:
        params: The unit's ``(name, parameter)`` pairs.
        policy: Its mixed-precision policy.

    Returns:
        That of its first trainable (else first) parameter.
    """
    trainable = [p for _, p in params if p.requires_grad] or [p for _, p in params]
    if not trainable:
        return policy.reduce_dtype or policy.param_dtype or torch.float32
    return param_reduce_dtype(trainable[0], policy)


def _unit_collectives(
    params: list[tuple[str, nn.Parameter]],
    policy: MixedPrecisionPolicy,
    gathered: int,
    regathers: bool,
    shape: MeshShape,
) -> CommTally:
    """The collectives one unit issues in a step (``regathers``: in backward too)."""
    tally = CommTally()
    shard, replicate = shape.dp_shard, shape.dp_replicate
    if not params:
        return tally
    if shard > 1:
        tally.add("forward", "all_gather", gathered)
        if regathers:
            tally.add("backward", "all_gather", gathered)
    trainable = [p for _, p in params if p.requires_grad]
    if not trainable:
        return tally
    reduce = unit_reduce_dtype(params, policy)
    padded = sum(padded_shard_numel(p, shard) * shard for p in trainable)
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
    """Check the plan against the mesh and read, once, what the tallies share (the checks
    run in the order users have always seen their errors).

    Args:
        plan: The plan.
        model: The model it was made for.
        shape: The data-parallel mesh shape.
        no_backward: Paths no gradient reaches (``None``: the plan's judgement).
        with_backward: Paths whose units run backward all the same.
        media: The step's media, or ``None``.
        parallel: The job's dimensions beyond data parallelism, if any.

    Returns:
        The step.

    Raises:
        TypeError: ``media`` is not a ``StepMedia``.
        ValueError: a unit's ``reshard_after_forward`` does not fit the mesh.
    """
    for unit in plan.units:
        check_reshard_after_forward(unit.reshard_after_forward, shape.dp_shard)
    if no_backward is not None:
        free = list(no_backward)
    elif plan.backward_free_paths is not None:  # the planner's judgement
        free = list(plan.backward_free_paths)
    else:
        free = backward_free_paths(model)
    spans = module_spans(model)
    any_trainable = any(p.requires_grad for p in model.parameters())
    owned = unit_parameters(plan, model)
    if media is not None and not isinstance(media, StepMedia):
        raise TypeError(f"media must be a StepMedia, got {type(media).__name__}")
    hook = HookStep(plan=plan, model=model, mesh=shape, owned=owned, media=media, parallel=parallel)
    return CostedStep(
        hook, free, no_backward is None, tuple(with_backward), spans, any_trainable, owned
    )


def place_unit(
    unit: UnitPlan,
    params: list[tuple[str, nn.Parameter]],
    step: CostedStep,
    runs: Mapping[str, int],
) -> _Unit:
    """One unit where it runs in the step, with the collectives it issues there.

    Args:
        unit: The unit.
        params: Its ``(name, parameter)`` pairs.
        step: The resolved step.
        runs: How often the units under a module path run, as the hooks say.

    Returns:
        The unit on the parameter timeline.

    Raises:
        ValueError: a scalar parameter, or a unit path with no module.
    """
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
    gathered = sum(  # every parameter padded, in its compute dtype
        padded_shard_numel(p, shard) * shard * param_compute_dtype(p, unit.mp_policy).itemsize
        for _, p in params
    )
    regathers = reshard is not False and runs_backward
    collectives = _unit_collectives(params, unit.mp_policy, gathered, regathers, step.shape)
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
        sharded=sum(padded_shard_numel(p, shard) * p.dtype.itemsize for _, p in params),
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
