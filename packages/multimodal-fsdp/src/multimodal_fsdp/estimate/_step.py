"""The step a plan is costed for, and each unit placed in it with what it issues.

[`plan_costs`][multimodal_fsdp.estimate.costs.plan_costs] resolves the plan on its mesh
once (``resolve_step``): which module paths no gradient reaches, where each module sits
in the forward, which parameters each unit owns, and the
[`HookStep`][fsdp_core.runtime.HookStep] every runtime hook's cost model reads. Each unit
is then placed in that step (``place_unit``): whether its backward runs, what it gathers
and stores, and the collectives it issues as often as the hooks say it runs. The report
built from these lives in [`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs].
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.containers import is_under, module_spans
from fsdp_core.mesh import MeshShape
from fsdp_core.parallel_dims import ParallelDims
from fsdp_core.plan import UnitPlan, unit_parameters
from fsdp_core.runtime import HookStep
from fsdp_core.sharding import check_reshard_after_forward
from multimodal_fsdp.estimate.collectives import (
    CommTally,
    _gathered_bytes,
    _sharded_bytes,
    _unit_collectives,
)
from multimodal_fsdp.estimate.exchange import StepMedia
from multimodal_fsdp.estimate.timeline import _Unit, effective_reshard
from multimodal_fsdp.reachability import backward_free_paths

__all__ = ["CostedStep", "place_unit", "resolve_step"]


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
    return _Unit(
        plan=unit,
        params=params,
        start=min(step.spans[p][0] for p in unit.paths),
        end=max(step.spans[p][1] for p in unit.paths),
        reshard=reshard,
        runs_backward=runs_backward,
        gathered=gathered,
        sharded=_sharded_bytes(params, shard),
        comm=_repeated(collectives, _unit_runs(unit, runs)),
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


def _repeated(tally: CommTally, times: int) -> CommTally:
    """``tally`` issued ``times`` times (a unit that runs that often in the step)."""
    if times == 1:
        return tally
    result = CommTally()
    for _ in range(times):
        result.merge(tally)
    return result
