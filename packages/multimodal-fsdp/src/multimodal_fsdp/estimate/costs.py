"""What a sharding plan costs per rank and step, from the plan alone (no process group).

Users choose frozen-tower policies, fp32 islands and reshard settings from these numbers;
[`multimodal_fsdp.measure.comm`][multimodal_fsdp.measure.comm] counts the same collectives
on a real step and the tests hold the two equal. **One step** is one forward and backward
of a batch in which every module runs once. Per rank, FSDP2 (torch 2.13) then issues:

- forward: one all-gather per unit that owns parameters;
- backward: one all-gather per unit resharded after forward whose backward runs (frozen
  towers ahead of every trainable parameter see no gradient; ``no_backward`` and
  ``with_backward`` override that judgement), one reduce-scatter per trainable unit (and
  one all-reduce of the shard on an HSDP mesh); nothing for ``replicate`` parameters;
- the runtime hooks' collectives, each hook's own cost model
  ([`RuntimeHook.collectives`][fsdp_core.runtime.RuntimeHook.collectives]), e.g. the
  ``unused_params`` and ``replica_grad_reduce`` all-reduces and, for a given
  [`StepMedia`][multimodal_fsdp.estimate.exchange.StepMedia], the balanced-media exchange.

Without the prefetch guard
([`multimodal_fsdp.runtime.prefetch_guard`][multimodal_fsdp.runtime.prefetch_guard]) the
unit that finishes its forward right after a unit without backward re-gathers that unit in
its pre-backward; ``prefetch_guard=False`` counts that waste. The byte rules live in
[`multimodal_fsdp.estimate.units`][multimodal_fsdp.estimate.units], the peak of gathered
parameters in [`multimodal_fsdp.estimate.timeline`][multimodal_fsdp.estimate.timeline].
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.collective_count import CommTally
from fsdp_core.mesh import MeshShape, resolve_mesh_shape
from fsdp_core.parallel_dims import ParallelDims, local_shape
from fsdp_core.runtime import HookPlan
from fsdp_core.sharding import original_class
from multimodal_fsdp.balance._planned import BalancedTower, group_size
from multimodal_fsdp.balance.traffic import SLOT_INTS, STATUS_INTS
from multimodal_fsdp.estimate.exchange import (
    StepMedia,
    balance_hook,
    exchange_tally,
)
from multimodal_fsdp.estimate.render import format_bytes, format_costs
from multimodal_fsdp.estimate.timeline import _peaks, _prefetch_waste, _Unit
from multimodal_fsdp.estimate.units import (
    CostedStep,
    param_compute_dtype,
    place_unit,
    resolve_step,
    unit_reduce_dtype,
)
from multimodal_fsdp.media_hook_planning import planned_hooks
from multimodal_fsdp.record import plan_record

if TYPE_CHECKING:  # an annotation only: memory builds on this module
    from multimodal_fsdp.estimate.memory import MemoryEstimate

__all__ = ["PlanCosts", "UnitCost", "plan_costs", "resolve_cost_mesh"]


@dataclass(frozen=True)
class UnitCost:
    """One FSDP unit: what it holds and what it costs per rank and step."""

    index: int
    label: str
    paths: tuple[str, ...]
    role: str
    is_root: bool
    numel: int
    trainable_numel: int
    storage_dtypes: tuple[str, ...]
    compute_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool | int
    runs_backward: bool
    sharded_bytes: int
    gathered_bytes: int
    comm: CommTally
    #: Collectives that FSDP2's implicit backward prefetch adds without the guard.
    wasted: CommTally

    @property
    def frozen(self) -> bool:
        return self.numel > 0 and self.trainable_numel == 0

    @property
    def trainable(self) -> str:
        if self.numel == 0:
            return "empty"
        if self.trainable_numel == self.numel:
            return "trainable"
        return "frozen" if self.trainable_numel == 0 else "mixed"

    def as_dict(self) -> dict[str, Any]:
        """The unit's figures, JSON-ready.

        Returns:
            ``{name: value}``, with the tallies as dicts."""
        return {
            "index": self.index,
            "label": self.label,
            "paths": list(self.paths),
            "role": self.role,
            "root": self.is_root,
            "params": self.numel,
            "trainable_params": self.trainable_numel,
            "state": self.trainable,
            "storage_dtypes": list(self.storage_dtypes),
            "compute_dtype": self.compute_dtype,
            "reduce_dtype": self.reduce_dtype,
            "reshard_after_forward": self.reshard_after_forward,
            "runs_backward": self.runs_backward,
            "sharded_bytes_per_rank": self.sharded_bytes,
            "gathered_bytes": self.gathered_bytes,
            "collectives": self.comm.as_dict(),
            "wasted_without_guard": self.wasted.as_dict(),
        }


@dataclass(frozen=True)
class PlanCosts:
    """The costs of a plan on a mesh, per rank and per step (see the module doc)."""

    model: str
    mesh: MeshShape
    units: tuple[UnitCost, ...]
    comm: CommTally
    #: Collectives outside FSDP units (the schedule check), included in ``comm``.
    extra: CommTally
    prefetch_guard: bool
    sharded_param_bytes: int
    replicated_param_bytes: int
    replicated_numel: int
    peak_gathered_forward_bytes: int
    peak_gathered_backward_bytes: int
    policy: str | None = None
    precision: str | None = None
    notes: tuple[str, ...] = ()
    #: The runtime hooks the plan installs (their collectives are in ``extra``).
    hooks: tuple[HookPlan, ...] = ()
    #: Predicted per-rank memory of a step
    #: ([`multimodal_fsdp.estimate.memory`][multimodal_fsdp.estimate.memory]), if
    #: estimated.
    memory: MemoryEstimate | None = None
    #: The towers ``balance_media=True`` balances (their exchange is in ``extra`` only
    #: when ``media`` was given).
    balanced_towers: tuple[str, ...] = ()
    #: The balanced-media exchange's collectives (part of ``extra``), counted for the
    #: step's media; ``None`` when the plan balances no tower or no media was given.
    exchange: CommTally | None = None

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units) + self.replicated_numel

    @property
    def trainable_numel(self) -> int:
        return sum(u.trainable_numel for u in self.units)

    @property
    def wasted(self) -> CommTally:
        """What the implicit backward prefetch would add without the guard."""
        total = CommTally()
        for unit in self.units:
            total.merge(unit.wasted)
        return total

    def role_counts(self) -> dict[str, int]:
        """How many units each role has.

        Returns:
            ``{role: units}``."""
        return dict(Counter(u.role for u in self.units))

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready.

        Returns:
            The totals, units, notes, hooks and memory as plain dicts and lists."""
        return {
            "model": self.model,
            "world_size": self.world_size,
            "dp_replicate": self.mesh.dp_replicate,
            "dp_shard": self.mesh.dp_shard,
            "policy": self.policy,
            "precision": self.precision,
            "prefetch_guard": self.prefetch_guard,
            "totals": {
                "units": len(self.units),
                "roles": self.role_counts(),
                "params": self.numel,
                "trainable_params": self.trainable_numel,
                "replicated_params": self.replicated_numel,
                "sharded_param_bytes_per_rank": self.sharded_param_bytes,
                "replicated_param_bytes_per_rank": self.replicated_param_bytes,
                "peak_gathered_forward_bytes": self.peak_gathered_forward_bytes,
                "peak_gathered_backward_bytes": self.peak_gathered_backward_bytes,
                "collectives": self.comm.as_dict(),
                "extra_collectives": self.extra.as_dict(),
                "wasted_without_guard": self.wasted.as_dict(),
            },
            "units": [u.as_dict() for u in self.units],
            "notes": list(self.notes),
            "hooks": [hook.as_dict() for hook in self.hooks],
            "memory": None if self.memory is None else self.memory.as_dict(),
            **(
                {
                    "balanced_towers": list(self.balanced_towers),
                    "exchange_collectives": (
                        None if self.exchange is None else self.exchange.as_dict()
                    ),
                }
                if self.balanced_towers
                else {}
            ),
        }

    def format(self, *, collapse: bool = True) -> str:
        """The plan as a tree of units with their costs, then the totals.

        Args:
            collapse: Merge runs of identical numbered layers into one row.

        Returns:
            The text the ``plan`` command prints.
        """
        return format_costs(self, collapse=collapse)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_cost_mesh(
    mesh: MeshShape | ParallelDims | None, world_size: int | None, dp_replicate: int
) -> MeshShape:
    """The data-parallel mesh shape costs are computed for.

    Args:
        mesh: A mesh shape, or a ``ParallelDims`` (its data-parallel shape); or ``None``.
        world_size: Ranks of the mesh when ``mesh`` is ``None``.
        dp_replicate: HSDP replicas of ``world_size``.

    Returns:
        The shape.

    Raises:
        TypeError: ``mesh`` is neither a ``MeshShape`` nor a ``ParallelDims``.
        ValueError: neither ``mesh`` nor ``world_size`` is given.
    """
    if isinstance(mesh, ParallelDims):
        return mesh.dp_shape
    if mesh is not None:
        if not isinstance(mesh, MeshShape):
            raise TypeError(
                "mesh must be a fsdp_core.MeshShape or fsdp_core.parallel_dims.ParallelDims, "
                f"got {type(mesh).__name__}"
            )
        return mesh
    if world_size is None:
        raise ValueError("give a world_size (and optionally dp_replicate) or a mesh shape")
    return resolve_mesh_shape(world_size=world_size, dp_replicate=dp_replicate)


def plan_costs(
    plan: ShardingPlan,
    model: nn.Module,
    *,
    world_size: int | None = None,
    dp_replicate: int = 1,
    mesh: MeshShape | ParallelDims | None = None,
    no_backward: Iterable[str] | None = None,
    with_backward: Iterable[str] = (),
    prefetch_guard: bool = True,
    policy: str | None = None,
    precision: str | None = None,
    media: StepMedia | None = None,
) -> PlanCosts:
    """Cost ``plan`` for ``model`` on a mesh (``world_size``/``dp_replicate`` or ``mesh``).

    ``model`` may be on the meta device (shapes, dtypes and ``requires_grad`` are read);
    the rest comes from the plan as ``plan()`` recorded it: the hooks' collectives, the
    replicated dtypes, the paths no gradient reaches (a hand-built plan gets
    [`backward_free_paths`][multimodal_fsdp.reachability.backward_free_paths]).

    Args:
        plan: The plan to cost.
        model: The model it was made for.
        world_size: Ranks of a data-parallel mesh; or give ``mesh``.
        dp_replicate: HSDP replicas of ``world_size``.
        mesh: The mesh shape, or the job's ``ParallelDims`` (units are costed on its
            data-parallel shape, DTensor parameters by their local shard).
        no_backward: Module paths no gradient reaches, replacing the plan's judgement.
        with_backward: Paths whose units count as running backward all the same.
        prefetch_guard: Whether the prefetch guard is installed.
        policy: A label for the report (default: the plan's policy).
        precision: A label for the report.
        media: The step's media for the towers the plan balances: their exchange is
            counted for ``media.rank`` (without, a note gives its collectives per call).

    Returns:
        The costs (without memory: see ``inspect_model``).

    Raises:
        TypeError: ``plan`` or ``model`` has the wrong type.
    """
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    shape = resolve_cost_mesh(mesh, world_size, dp_replicate)
    parallel = mesh if isinstance(mesh, ParallelDims) and not mesh.is_data_parallel_only else None
    step = resolve_step(plan, model, shape, no_backward, with_backward, media, parallel=parallel)
    hooks = [hook for _, hook in planned_hooks(plan, model) if hook is not None]
    runs: dict[str, int] = {}
    for hook in hooks:
        runs.update(hook.unit_runs(step.hook))
    units = [
        place_unit(unit, params, step, runs)
        for unit, params in zip(plan.units, step.owned, strict=True)
    ]
    _prefetch_waste(units, shape.dp_shard)
    balance = balance_hook(plan)
    counted: object = (
        balance if media is not None and balance is not None and balance.towers else None
    )
    extra, exchange = CommTally(), None
    for hook in hooks:
        tally = hook.collectives(step.hook)
        extra.merge(tally)
        if hook is counted:  # the balanced-media exchange, reported apart as well
            exchange = tally
    if media is not None and balance is None:  # media no hook reads: checked as ever
        exchange_tally(media, (), world_size=shape.world_size)
    return _costs_of(step, units, extra, exchange, prefetch_guard, policy, precision)


def _costs_of(
    step: CostedStep,
    units: list[_Unit],
    extra: CommTally,
    exchange: CommTally | None,
    prefetch_guard: bool,
    policy: str | None,
    precision: str | None,
) -> PlanCosts:
    """The report from the tallies: totals, peaks and the notes on what they leave out."""
    total = CommTally()
    for item in units:
        total.merge(item.comm)
        if not prefetch_guard:
            total.merge(item.wasted)
    total.merge(extra)
    plan, shape = step.plan, step.shape
    replicated_numel, replicated_bytes = _replicated(plan, step.model)
    forward_peak, backward_peak = _peaks(units, step.spans[""][1], guard=prefetch_guard)
    notes = list(plan.notes)
    record = plan_record(plan)
    if step.free and step.free_judged:
        notes.append(f"no gradient reaches {sorted(step.free)} (media inputs only)")
    hook = balance_hook(plan)
    towers = () if hook is None else hook.towers
    if hook is not None and towers and step.media is None:
        world = group_size(hook.group, shape.world_size, shape.dp_replicate)
        notes.append(_exchange_note(towers, world, shape.world_size))
    return PlanCosts(
        model=original_class(step.model).__name__,  # not FSDP2's ``FSDP<name>``
        mesh=shape,
        units=tuple(_unit_cost(i, item) for i, item in enumerate(units)),
        comm=total,
        extra=extra,
        prefetch_guard=prefetch_guard,
        sharded_param_bytes=sum(u.sharded for u in units),
        replicated_param_bytes=replicated_bytes,
        replicated_numel=replicated_numel,
        peak_gathered_forward_bytes=forward_peak,
        peak_gathered_backward_bytes=backward_peak,
        policy=policy or (None if record is None else record.policies.label),
        precision=precision,
        notes=tuple(notes),
        hooks=plan.hooks,
        balanced_towers=tuple(tower.path for tower in towers),
        exchange=exchange,
    )


def _exchange_note(towers: Iterable[BalancedTower], world: int, ranks: int) -> str:
    """What each balanced tower's exchange costs per call, when no media says how many
    calls there are, balanced over ``world`` of the ``ranks`` data-parallel ranks."""
    slot = format_bytes(world * SLOT_INTS * 8)
    status = format_bytes(world * STATUS_INTS * 8)
    parts = []
    for tower in towers:
        backward = "1 all_to_all (output gradients)" if tower.trainable else "none"
        parts.append(
            f"{tower.path!r} per call: forward 1 all_gather (slot {slot}); when items move, "
            f"1 more all_gather (status {status}) and 2 all_to_all (inputs, outputs), "
            f"backward {backward} (+1 all_to_all when inputs need a gradient); per forward "
            f"1 all_gather ({slot}, the join barrier)"
        )
    return (
        "balanced-media exchange NOT counted above: its calls and bytes depend on the "
        "step's media (give plan_costs media=, e.g. from record_step_media, or the CLI --batch); "
        + "; ".join(parts)
        + (
            f"; each call balanced over all {ranks} data-parallel ranks"
            if world == ranks
            else f"; each call balanced within a group of {world} of the {ranks} data-parallel "
            "ranks"
        )
    )


def _replicated(plan: ShardingPlan, model: nn.Module) -> tuple[int, int]:
    """Elements and per-rank bytes of ignored parameters, in the dtypes the planner
    recorded (else their own)."""
    named = dict(model.named_parameters())
    names = [n for n in plan.ignored_param_names if n in named]
    dtypes = dict(plan.replicated_param_dtypes)
    total = 0
    for name in names:
        param = named[name]
        total += local_shape(param).numel() * dtypes.get(name, param.dtype).itemsize
    return sum(named[n].numel() for n in names), total


def _unit_cost(index: int, item: _Unit) -> UnitCost:
    params = [p for _, p in item.params]
    policy = item.plan.mp_policy
    compute = sorted({_short(param_compute_dtype(p, policy)) for p in params}) or ["-"]
    return UnitCost(
        index=index,
        label=item.plan.label,
        paths=item.plan.paths,
        role=item.plan.role,
        is_root=item.plan.is_root,
        numel=sum(p.numel() for p in params),
        trainable_numel=sum(p.numel() for p in params if p.requires_grad),
        storage_dtypes=tuple(sorted({_short(p.dtype) for p in params})),
        compute_dtype=",".join(compute),
        reduce_dtype=_short(unit_reduce_dtype(item.params, policy)) if params else "-",
        reshard_after_forward=item.reshard,
        runs_backward=item.runs_backward,
        sharded_bytes=item.sharded,
        gathered_bytes=item.gathered,
        comm=item.comm,
        wasted=item.wasted,
    )
