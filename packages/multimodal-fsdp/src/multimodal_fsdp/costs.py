"""What a sharding plan costs, computed from the plan alone (no process group).

Users pick a frozen-tower policy, fp32 islands and reshard settings; this
module turns a :class:`~fsdp_core.ShardingPlan` and its (meta-device) model
into the numbers that decide between them: per FSDP unit and per rank, the
sharded bytes, the collectives of a training step and the peak of gathered
parameters. :mod:`multimodal_fsdp.measure` counts the same collectives on a
real step; the two agree exactly (the project's tests hold them to it).

**One step** is one forward and one backward of one batch in which every
module runs once and every trainable parameter receives a gradient. Per rank
and per step, FSDP2 (torch 2.13) then issues:

- forward: one all-gather per unit that owns parameters (the root included);
- backward: one all-gather per unit that is resharded after forward (every
  non-root unit unless ``reshard_after_forward=False``; the root only when
  asked) *and whose backward runs* - a unit runs backward when its output
  needs a gradient, i.e. it has trainable parameters or a gradient flows
  through it. Frozen parts of towers and projectors ahead of every trainable
  parameter of their modality see no gradient (their inputs are pixels or
  audio); ``no_backward``/``with_backward`` override that judgement;
- backward: one reduce-scatter per unit with trainable parameters (plus one
  all-reduce of the reduced shard per unit on an HSDP mesh);
- nothing for parameters outside FSDP (``replicate``);
- forward: one 16-byte all-reduce per checkpoint (per mesh dimension) of the
  ``schedule_check`` hook, when media regions own units (:mod:`multimodal_fsdp.uneven`);
- backward: one all-reduce of one byte per trainable FSDP parameter (per mesh
  dimension) of the ``unused_params`` hook (:mod:`fsdp_core.unused_params`).

Without the prefetch guard (:mod:`multimodal_fsdp.prefetch`) the unit that
finishes its forward right after a unit without backward re-gathers that unit
in its pre-backward; ``prefetch_guard=False`` accounts for that waste.

Bytes follow :class:`fsdp_core.CommCounter`: the unsharded buffer of each
collective, with FSDP's padding of every parameter's dim 0 to a multiple of
the shard-group size, in the dtype on the wire (the compute dtype for
all-gathers, the reduce dtype for reduce-scatters).

Peak gathered memory is a timeline model: units run in module registration
order (the forward order of the models this project serves), each unit is
gathered from its first member's forward to its last member's, and kept until
backward when it is not resharded; in backward each unit is gathered from its
pre-backward to its post-backward, and the implicit prefetch gathers the next
one early. Transient all-gather staging buffers are not included.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core import (
    HookPlan,
    MeshShape,
    ShardCall,
    ShardingPlan,
    UnitPlan,
    check_reshard_after_forward,
    mixed_precision_policy,
    resolve_mesh_shape,
    unit_parameters,
)
from fsdp_core.containers import join_path
from multimodal_fsdp.parallelizer import MultimodalParallelizer, MultimodalParts
from multimodal_fsdp.uneven import CHECKPOINT_BYTES, plan_schedule_layout

if TYPE_CHECKING:
    from multimodal_fsdp.memory import MemoryEstimate

__all__ = [
    "KINDS",
    "PHASES",
    "CommTally",
    "PlanCosts",
    "UnitCost",
    "backward_free_paths",
    "format_bytes",
    "inspect_model",
    "plan_costs",
    "ungroup_units",
]

logger = logging.getLogger(__name__)

PHASES: tuple[str, ...] = ("forward", "backward")
KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


# --------------------------------------------------------------------------- tallies
@dataclass
class CommTally:
    """Collectives of one step: per (phase, kind), how many and how many bytes."""

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, phase: str, kind: str, nbytes: int, count: int = 1) -> None:
        if count <= 0:
            return
        key = (phase, kind)
        self.counts[key] = self.counts.get(key, 0) + count
        self.nbytes[key] = self.nbytes.get(key, 0) + nbytes

    def merge(self, other: CommTally) -> None:
        for key, count in other.counts.items():
            self.add(key[0], key[1], other.nbytes.get(key, 0), count)

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        """Number of collectives, optionally of one kind and/or phase."""
        return sum(
            n for (p, k), n in self.counts.items() if kind in (None, k) and phase in (None, p)
        )

    def bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes (unsharded buffers), optionally of one kind and/or phase."""
        return sum(
            n for (p, k), n in self.nbytes.items() if kind in (None, k) and phase in (None, p)
        )

    def pairs(self) -> list[tuple[str, str]]:
        """(phase, kind) pairs present, phases and kinds in their natural order."""
        order = {name: i for i, name in enumerate((*PHASES, *KINDS))}
        return sorted(self.counts, key=lambda k: (order.get(k[0], 99), order.get(k[1], 99), k))

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {kind: {"count": n, "bytes": b}}}`` (JSON-ready)."""
        result: dict[str, dict[str, dict[str, int]]] = {}
        for phase, kind in self.pairs():
            result.setdefault(phase, {})[kind] = {
                "count": self.counts[(phase, kind)],
                "bytes": self.nbytes.get((phase, kind), 0),
            }
        return result

    def differences(self, other: CommTally) -> list[str]:
        """Readable lines where ``self`` (expected) and ``other`` (actual) differ."""
        lines = []
        for key in sorted(set(self.counts) | set(other.counts)):
            mine = (self.counts.get(key, 0), self.nbytes.get(key, 0))
            theirs = (other.counts.get(key, 0), other.nbytes.get(key, 0))
            if mine != theirs:
                lines.append(
                    f"{key[0]} {key[1]}: expected {mine[0]} ({mine[1]} B), "
                    f"got {theirs[0]} ({theirs[1]} B)"
                )
        return lines

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CommTally):
            return NotImplemented
        return not self.differences(other)

    __hash__ = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- results
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
    #: Predicted per-rank memory of a step (:mod:`multimodal_fsdp.memory`), if estimated.
    memory: MemoryEstimate | None = None

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
        return dict(Counter(u.role for u in self.units))

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready."""
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
            "hooks": [dataclasses.asdict(hook) for hook in self.hooks],
            "memory": None if self.memory is None else self.memory.as_dict(),
        }

    def format(self, *, collapse: bool = True) -> str:
        """The plan as a tree of units with their costs, then the totals."""
        return format_costs(self, collapse=collapse)


# --------------------------------------------------------------------------- helpers
def format_bytes(value: float) -> str:
    """``1.5 MiB``-style sizes (binary units)."""
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dim0_padded_numel(shape: torch.Size, factor: int) -> int:
    """Elements after FSDP pads dim 0 to a multiple of ``factor``."""
    rows = math.ceil(shape[0] / factor) * factor
    return rows * math.prod(shape[1:])


def _module_spans(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Pre-order position and subtree end of every module (``named_modules`` order)."""
    spans: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()
    counter = 0
    stack: list[tuple[str, nn.Module, bool]] = [("", model, False)]
    starts: dict[str, int] = {}
    while stack:
        path, module, done = stack.pop()
        if done:
            spans[path] = (starts[path], counter)
            continue
        if id(module) in seen:
            continue
        seen.add(id(module))
        starts[path] = counter
        counter += 1
        stack.append((path, module, True))
        children = [(join_path(path, name), child) for name, child in module.named_children()]
        stack.extend((p, c, False) for p, c in reversed(children))
    return spans


def _effective_reshard(unit: UnitPlan, shard: int) -> bool | int:
    """What FSDP2 does after forward: root ``None`` keeps, others ``None`` reshard."""
    value = unit.reshard_after_forward
    if value is None:
        return not unit.is_root
    if isinstance(value, bool):
        return value
    if value == 1:
        return False
    if value == shard:
        return True
    return value


# --------------------------------------------------------------------------- backward
def _parts_in_flow_order(parts: Sequence[MultimodalParts]) -> dict[str, list[MultimodalParts]]:
    """Multimodal modules per modality, towers before projectors (the data flow)."""
    groups: dict[str, list[MultimodalParts]] = {}
    for part in parts:
        groups.setdefault(part.found.modality, []).append(part)
    for members in groups.values():
        members.sort(key=lambda p: 0 if p.found.role == "tower" else 1)
    return groups


def backward_free_paths(
    model: nn.Module, parallelizer: MultimodalParallelizer | None = None
) -> list[str]:
    """Frozen module paths that no gradient reaches in a step.

    Per modality, towers then projectors are walked in registration order; the
    frozen parts met before the first trainable parameter (or the first module
    holding one directly) see only media inputs, so their backward never runs.
    """
    found = (parallelizer or MultimodalParallelizer()).multimodal_parts(model)
    spans = _module_spans(model)
    free: list[str] = []
    for members in _parts_in_flow_order(found).values():
        for part in members:
            events: list[tuple[int, str, str]] = [
                (spans[p][0], "frozen", p) for p in part.frozen if p in spans
            ]
            events += [(spans[p][0], "trainable", p) for p in part.trainable if p in spans]
            # Trainable parameters held directly by a mixed module stop the walk there.
            root = part.found.module
            for name, sub in root.named_modules(prefix=part.found.path):
                if any(p.requires_grad for p in sub.parameters(recurse=False)) and name in spans:
                    events.append((spans[name][0], "trainable", name))
            stop = False
            for _, kind, path in sorted(events):
                if kind == "trainable":
                    stop = True
                    break
                free.append(path)
            if stop:
                break
    return free


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(r == "" or path == r or path.startswith(r + ".") for r in roots)


# --------------------------------------------------------------------------- main
@dataclass
class _Unit:
    plan: UnitPlan
    params: list[tuple[str, nn.Parameter]]
    start: int
    end: int
    reshard: bool | int
    runs_backward: bool
    gathered: int
    sharded: int
    comm: CommTally = field(default_factory=CommTally)
    wasted: CommTally = field(default_factory=CommTally)


def _resolve_mesh(mesh: MeshShape | None, world_size: int | None, dp_replicate: int) -> MeshShape:
    if mesh is not None:
        if not isinstance(mesh, MeshShape):
            raise TypeError(f"mesh must be a fsdp_core.MeshShape, got {type(mesh).__name__}")
        return mesh
    if world_size is None:
        raise ValueError("give a world_size (and optionally dp_replicate) or a mesh shape")
    return resolve_mesh_shape(world_size=world_size, dp_replicate=dp_replicate)


def _schedule_checkpoints(
    parallelizer: MultimodalParallelizer | None, model: nn.Module, plan: ShardingPlan, world: int
) -> int:
    """All-reduces of the ``schedule_check`` hook in one step (every region runs once)."""
    if parallelizer is None or world <= 1 or plan.hook("schedule_check") is None:
        return 0
    layout = plan_schedule_layout(model, plan, parallelizer.media_regions(model, plan))
    return 0 if layout is None else layout.checkpoints_per_forward()


def plan_costs(
    plan: ShardingPlan,
    model: nn.Module,
    *,
    world_size: int | None = None,
    dp_replicate: int = 1,
    mesh: MeshShape | None = None,
    parallelizer: MultimodalParallelizer | None = None,
    no_backward: Iterable[str] | None = None,
    with_backward: Iterable[str] = (),
    prefetch_guard: bool = True,
    policy: str | None = None,
    precision: str | None = None,
) -> PlanCosts:
    """Cost ``plan`` for ``model`` on a mesh (``world_size``/``dp_replicate`` or ``mesh``).

    ``model`` may be on the meta device (only shapes, dtypes and
    ``requires_grad`` are read). ``parallelizer`` (the one that made the plan)
    finds the towers for the backward judgement and the media regions of the
    schedule check. ``no_backward`` replaces the judgement of which module
    paths see no gradient (:func:`backward_free_paths`); ``with_backward`` forces
    units under those paths to count as running backward.
    """
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if parallelizer is not None and not isinstance(parallelizer, MultimodalParallelizer):
        raise TypeError(
            f"parallelizer must be a MultimodalParallelizer, got {type(parallelizer).__name__}"
        )
    shape = _resolve_mesh(mesh, world_size, dp_replicate)
    shard, replicate = shape.dp_shard, shape.dp_replicate
    for unit in plan.units:
        check_reshard_after_forward(unit.reshard_after_forward, shard)
    free = (
        list(no_backward) if no_backward is not None else backward_free_paths(model, parallelizer)
    )
    forced = tuple(with_backward)
    spans = _module_spans(model)
    any_trainable = any(p.requires_grad for p in model.parameters())
    owned = unit_parameters(plan, model)

    units: list[_Unit] = []
    for unit, params in zip(plan.units, owned, strict=True):
        scalars = [name for name, p in params if p.dim() == 0]
        if scalars:
            raise ValueError(
                f"unit {unit.label}: fully_shard does not support scalar parameters "
                f"{scalars}; make them 1-D (numel 1) or ignore them"
            )
        missing = [p for p in unit.paths if p not in spans]
        if missing:
            raise ValueError(f"unit {unit.label}: no module at {missing} in the model")
        start = min(spans[p][0] for p in unit.paths)
        end = max(spans[p][1] for p in unit.paths)
        trainable = any(p.requires_grad for _, p in params)
        gradient_free = not trainable and all(_under(p, free) for p in unit.paths)
        if any(_under(p, forced) for p in unit.paths):
            gradient_free = False
        runs_backward = any_trainable and (unit.is_root or not gradient_free)
        units.append(
            _Unit(
                plan=unit,
                params=params,
                start=start,
                end=end,
                reshard=_effective_reshard(unit, shard),
                runs_backward=runs_backward,
                gathered=_gathered_bytes(params, unit.mp_policy, shard),
                sharded=_sharded_bytes(params, shard),
            )
        )

    for item in units:
        _unit_collectives(item, shard, replicate)
    _prefetch_waste(units, shard)

    extra = CommTally()
    checkpoints = _schedule_checkpoints(parallelizer, model, plan, shape.world_size)
    dims = sum(1 for size in shape.sizes if size > 1)
    for _ in range(checkpoints * dims):
        extra.add("forward", "all_reduce", CHECKPOINT_BYTES)
    if plan.hook("unused_params") is not None and shape.world_size > 1:
        # One usage flag (a byte) per trainable parameter tensor that a unit manages.
        flags = sum(1 for params in owned for _, p in params if p.requires_grad)
        for _ in range(dims):
            extra.add("backward", "all_reduce", flags)
    total = CommTally()
    for item in units:
        total.merge(item.comm)
        if not prefetch_guard:
            total.merge(item.wasted)
    total.merge(extra)

    replicated_numel, replicated_bytes = _replicated(plan, model, parallelizer)
    forward_peak, backward_peak = _peaks(units, spans[""][1], guard=prefetch_guard)
    notes = list(plan.notes)
    if free and no_backward is None:
        notes.append(f"no gradient reaches {sorted(free)} (media inputs only)")
    return PlanCosts(
        model=_model_name(model),
        mesh=shape,
        units=tuple(_unit_cost(i, item, shard) for i, item in enumerate(units)),
        comm=total,
        extra=extra,
        prefetch_guard=prefetch_guard,
        sharded_param_bytes=sum(u.sharded for u in units),
        replicated_param_bytes=replicated_bytes,
        replicated_numel=replicated_numel,
        peak_gathered_forward_bytes=forward_peak,
        peak_gathered_backward_bytes=backward_peak,
        policy=policy or (parallelizer.frozen_multimodal_sharding if parallelizer else None),
        precision=precision,
        notes=tuple(notes),
        hooks=plan.hooks,
    )


def _model_name(model: nn.Module) -> str:
    """The model's own class name (FSDP2 swaps in a subclass named ``FSDP<name>``)."""
    return next(
        (c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP")),
        type(model).__name__,
    )


def _compute_dtype(param: nn.Parameter, policy: MixedPrecisionPolicy) -> torch.dtype:
    if policy.param_dtype is not None and param.dtype.is_floating_point:
        return policy.param_dtype
    return param.dtype


def _reduce_dtype(
    params: list[tuple[str, nn.Parameter]], policy: MixedPrecisionPolicy
) -> torch.dtype:
    trainable = [p for _, p in params if p.requires_grad] or [p for _, p in params]
    if not trainable:
        return policy.reduce_dtype or policy.param_dtype or torch.float32
    compute = _compute_dtype(trainable[0], policy)
    return policy.reduce_dtype if policy.reduce_dtype is not None else compute


def _gathered_bytes(
    params: list[tuple[str, nn.Parameter]], policy: MixedPrecisionPolicy, shard: int
) -> int:
    """All-gather output bytes: every parameter padded, in its compute dtype."""
    return sum(
        _dim0_padded_numel(p.shape, shard) * _compute_dtype(p, policy).itemsize for _, p in params
    )


def _sharded_bytes(params: list[tuple[str, nn.Parameter]], shard: int) -> int:
    """Bytes one rank stores: its padded shard of each parameter, in the storage dtype."""
    return sum(_dim0_padded_numel(p.shape, shard) // shard * p.dtype.itemsize for _, p in params)


def _unit_collectives(item: _Unit, shard: int, replicate: int) -> None:
    if not item.params:
        return
    if shard > 1:
        item.comm.add("forward", "all_gather", item.gathered)
        if item.reshard is not False and item.runs_backward:
            item.comm.add("backward", "all_gather", item.gathered)
    trainable = [p for _, p in item.params if p.requires_grad]
    if not trainable:
        return
    reduce = _reduce_dtype(item.params, item.plan.mp_policy)
    padded = sum(_dim0_padded_numel(p.shape, shard) for p in trainable)
    if shard > 1:
        item.comm.add("backward", "reduce_scatter", padded * reduce.itemsize)
    if replicate > 1:
        item.comm.add("backward", "all_reduce", padded // shard * reduce.itemsize)


def _post_forward_order(units: list[_Unit]) -> list[_Unit]:
    """Units in the order their forwards finish (inner units first on a tie)."""
    return sorted((u for u in units if u.params), key=lambda u: (u.end, -u.start, u.plan.is_root))


def _prefetch_waste(units: list[_Unit], shard: int) -> None:
    """Without the guard, a unit's pre-backward re-gathers its predecessor without backward."""
    if shard <= 1:
        return
    order = _post_forward_order(units)
    for previous, current in itertools.pairwise(order):
        if current.runs_backward and not previous.runs_backward and previous.reshard is not False:
            previous.wasted.add("backward", "all_gather", previous.gathered)


def _peaks(units: list[_Unit], end: int, *, guard: bool) -> tuple[int, int]:
    """Peak gathered parameter bytes in forward and in backward (timeline model)."""
    forward: list[tuple[int, int, int]] = []  # (start, stop, bytes) on module positions
    backward: list[tuple[int, int, int]] = []
    order = _post_forward_order(units)
    prefetched_at = {
        id(prev): cur.end for prev, cur in itertools.pairwise(order) if cur.runs_backward
    }
    for u in units:
        if not u.params:
            continue
        full = u.gathered
        forward.append((u.start, u.end, full))
        kept = 0 if u.reshard is True else full if u.reshard is False else full // int(u.reshard)
        if kept:
            forward.append((u.end, end, kept))
        early = prefetched_at.get(id(u), u.end)
        if u.runs_backward:
            if u.reshard is False:
                backward.append((u.start, end, full))
            else:
                top = max(u.end, early)
                backward.append((u.start, top, full))
                if kept and top < end:
                    backward.append((top, end, kept))
        elif u.reshard is False:
            backward.append((0, end, full))
        else:
            if kept:
                backward.append((0, end, kept))
            if not guard and id(u) in prefetched_at:
                backward.append((0, early, full))
    return _sweep_max(forward), _sweep_max(backward)


def _sweep_max(segments: list[tuple[int, int, int]]) -> int:
    """Largest total of ``bytes`` over half-open ``[start, stop)`` segments at one point."""
    events: list[tuple[int, int]] = []
    for start, stop, nbytes in segments:
        if stop > start:
            events += [(start, nbytes), (stop, -nbytes)]
    best = live = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1] > 0)):  # ends before starts
        live += change
        best = max(best, live)
    return best


def _replicated(
    plan: ShardingPlan, model: nn.Module, parallelizer: MultimodalParallelizer | None
) -> tuple[int, int]:
    """Elements and per-rank bytes of parameters kept whole (ignored) on every rank."""
    named = dict(model.named_parameters())
    names = [n for n in plan.ignored_param_names if n in named]
    dtypes: dict[str, torch.dtype] = {}
    if parallelizer is not None and plan.replicated_param_names:
        dtypes = parallelizer.replicated_param_dtypes(model, plan)
    total = 0
    for name in names:
        param = named[name]
        total += param.numel() * dtypes.get(name, param.dtype).itemsize
    return sum(named[n].numel() for n in names), total


def _unit_cost(index: int, item: _Unit, shard: int) -> UnitCost:
    params = [p for _, p in item.params]
    policy = item.plan.mp_policy
    compute = sorted({_short(_compute_dtype(p, policy)) for p in params}) or ["-"]
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
        reduce_dtype=_short(_reduce_dtype(item.params, policy)) if params else "-",
        reshard_after_forward=item.reshard,
        runs_backward=item.runs_backward,
        sharded_bytes=item.sharded,
        gathered_bytes=item.gathered,
        comm=item.comm,
        wasted=item.wasted,
    )


# --------------------------------------------------------------------------- variants
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
            ignored = tuple(n for n in call.ignored_param_names if _under(n, [path]))
            unit = UnitPlan(
                paths=(path,),
                mp_policy=call.mp_policy,
                reshard_after_forward=call.reshard_after_forward,
                ignored_param_names=ignored,
                role=call.units[0].role,
            )
            calls.append(
                ShardCall(
                    paths=(path,),
                    mp_policy=call.mp_policy,
                    reshard_after_forward=call.reshard_after_forward,
                    ignored_param_names=ignored,
                    units=(unit,),
                )
            )
    return dataclasses.replace(plan, calls=tuple(calls))


# --------------------------------------------------------------------------- one call
def inspect_model(
    model: nn.Module,
    *,
    world_size: int | None = None,
    dp_replicate: int = 1,
    mesh: MeshShape | None = None,
    precision: str = "bf16",
    reduce_precision: str | None = "fp32",
    policy: str = "root",
    parallelizer: MultimodalParallelizer | None = None,
    reshard_after_forward: bool | int | None = None,
    prefetch_guard: bool = True,
    no_backward: Iterable[str] | None = None,
    optimizer: str | None = "adamw",
    loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
) -> PlanCosts:
    """Plan ``model`` with ``parallelizer`` (default :class:`MultimodalParallelizer`)
    under ``policy`` and ``precision``, then cost the plan (see :func:`plan_costs`).

    Unless ``optimizer`` is ``None``, the costs carry the predicted memory of a
    step with that optimizer (:mod:`multimodal_fsdp.memory`); with ``loss_fn``
    (one batch's loss) the activations are traced and included in the peak."""
    if parallelizer is None:
        parallelizer = MultimodalParallelizer()
    if not isinstance(parallelizer, MultimodalParallelizer):
        raise TypeError(
            f"parallelizer must be a MultimodalParallelizer, got {type(parallelizer).__name__}"
        )
    shape = _resolve_mesh(mesh, world_size, dp_replicate)
    check_reshard_after_forward(reshard_after_forward, shape.dp_shard)
    chosen = parallelizer.with_options(frozen_multimodal_sharding=policy)
    mp = mixed_precision_policy(precision, reduce_precision)
    plan = chosen.plan(model, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    costs = plan_costs(
        plan,
        model,
        mesh=shape,
        parallelizer=chosen,
        prefetch_guard=prefetch_guard,
        no_backward=no_backward,
        policy=chosen.frozen_multimodal_sharding,
        precision=f"param={precision} reduce={reduce_precision}",
    )
    if optimizer is None:
        return costs
    from multimodal_fsdp.activations import trace_activations
    from multimodal_fsdp.memory import with_memory  # imports this module

    traced = (
        None
        if loss_fn is None
        else trace_activations(model, plan, loss_fn, parallelizer=chosen, shard=shape.dp_shard)
    )
    return with_memory(costs, plan, model, optimizer=optimizer, activations=traced)


# --------------------------------------------------------------------------- text
_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def _dt(name: str) -> str:
    return ",".join(_SHORT_DTYPES.get(part, part) for part in name.split(","))


def format_count(value: int) -> str:
    """``1.2M``-style parameter counts."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return str(value)


def _reshard_text(value: bool | int) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return f"to {value}"


def _comm_text(tally: CommTally, phase: str, kind: str) -> str:
    count = tally.count(kind, phase)
    return "-" if not count else f"{count}x {format_bytes(tally.bytes(kind, phase))}"


def _unit_columns(unit: UnitCost) -> list[str]:
    storage = ",".join(_dt(d) for d in unit.storage_dtypes) or "-"
    return [
        unit.role,
        format_count(unit.numel),
        unit.trainable + ("" if unit.runs_backward or not unit.numel else " (no bwd)"),
        f"{storage}>{_dt(unit.compute_dtype)}",
        _reshard_text(unit.reshard_after_forward),
        format_bytes(unit.sharded_bytes),
        _comm_text(unit.comm, "forward", "all_gather"),
        _comm_text(unit.comm, "backward", "all_gather"),
        _comm_text(unit.comm, "backward", "reduce_scatter"),
    ]


_HEADER = [
    "unit",
    "role",
    "params",
    "state",
    "dtype",
    "reshard",
    "shard/rank",
    "AG fwd",
    "AG bwd",
    "RS",
]


def _signature(unit: UnitCost) -> tuple[Any, ...]:
    return (*_unit_columns(unit), repr(unit.comm.as_dict()))


class _Node:
    def __init__(self, name: str) -> None:
        self.name = name
        self.children: dict[str, _Node] = {}
        self.units: list[UnitCost] = []


def _anchor(unit: UnitCost) -> tuple[list[str], str | None]:
    """Tree position of a unit: its path, or the common prefix of a group's members."""
    if len(unit.paths) == 1:
        return ([p for p in unit.paths[0].split(".") if p], None)
    split = [p.split(".") for p in unit.paths]
    prefix: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return prefix, f"[{len(unit.paths)} modules]"


def _tree_rows(costs: PlanCosts, collapse: bool) -> list[tuple[str, UnitCost | None]]:
    root = _Node("")
    for unit in costs.units:
        parts, group = _anchor(unit)
        node = root
        for part in parts:
            node = node.children.setdefault(part, _Node(part))
        if group is None:
            node.units.append(unit)
        else:
            node.children.setdefault(group + f"#{unit.index}", _Node(group)).units.append(unit)
    rows: list[tuple[str, UnitCost | None]] = []
    for unit in root.units:
        rows.append(("<root>", unit))
    if not root.units:
        rows.append((costs.model, None))

    def visit(node: _Node, indent: str) -> None:
        entries = (
            _collapsed(list(node.children.values()))
            if collapse
            else [(child.name, child) for child in node.children.values()]
        )
        for i, (name, child) in enumerate(entries):
            last = i == len(entries) - 1
            branch = "`- " if last else "|- "
            if child.units:
                for unit in child.units:
                    rows.append((indent + branch + name, unit))
            else:
                rows.append((indent + branch + name, None))
            visit(child, indent + ("   " if last else "|  "))

    visit(root, "")
    return rows


def _collapsed(children: list[_Node]) -> list[tuple[str, _Node]]:
    """Merge runs of numbered leaf siblings with identical figures into ``{a..b} xN``."""
    out: list[tuple[str, _Node]] = []
    i = 0
    while i < len(children):
        child = children[i]
        j = i + 1
        if child.name.isdigit() and not child.children and len(child.units) == 1:
            sig = _signature(child.units[0])
            while (
                j < len(children)
                and children[j].name.isdigit()
                and not children[j].children
                and len(children[j].units) == 1
                and _signature(children[j].units[0]) == sig
            ):
                j += 1
        if j - i > 1:
            out.append((f"{{{child.name}..{children[j - 1].name}}} x{j - i}", child))
        else:
            out.append((child.name, child))
        i = j
    return out


def format_costs(costs: PlanCosts, *, collapse: bool = True) -> str:
    """A readable tree of the units with their per-rank costs, then the totals."""
    mesh = costs.mesh
    head = f"{costs.model}: {len(costs.units)} FSDP units, world size {costs.world_size}"
    head += (
        f" (dp_replicate {mesh.dp_replicate} x dp_shard {mesh.dp_shard})"
        if mesh.is_hsdp
        else f" (dp_shard {mesh.dp_shard})"
    )
    if costs.policy:
        head += f", frozen-tower policy {costs.policy}"
    if costs.precision:
        head += f", {costs.precision}"
    table = [_HEADER]
    for name, unit in _tree_rows(costs, collapse):
        table.append([name, *(["" for _ in _HEADER[1:]] if unit is None else _unit_columns(unit))])
    widths = [max(len(row[c]) for row in table) for c in range(len(_HEADER))]
    lines = [head, ""]
    for row in table:
        lines.append("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip())
    lines.append("")
    lines.append("totals per rank and step (one forward + backward, every module runs):")
    roles = ", ".join(f"{k} {v}" for k, v in sorted(costs.role_counts().items()))
    lines.append(f"  units                     {len(costs.units)} ({roles})")
    lines.append(
        f"  parameters                {format_count(costs.numel)} "
        f"(trainable {format_count(costs.trainable_numel)}, "
        f"kept whole on every rank {format_count(costs.replicated_numel)})"
    )
    lines.append(f"  sharded parameter bytes   {format_bytes(costs.sharded_param_bytes)}")
    lines.append(f"  replicated param bytes    {format_bytes(costs.replicated_param_bytes)}")
    lines.append(
        f"  peak gathered params      forward {format_bytes(costs.peak_gathered_forward_bytes)},"
        f" backward {format_bytes(costs.peak_gathered_backward_bytes)}"
    )
    if costs.memory is not None:
        lines.extend(costs.memory.format_lines())
    for phase, kind in costs.comm.pairs():
        label = f"{phase} {kind}"
        lines.append(
            f"  {label:<25} {costs.comm.count(kind, phase):>5}  "
            f"{format_bytes(costs.comm.bytes(kind, phase))}"
        )
    if not costs.comm.pairs():
        lines.append("  collectives               none")
    wasted = costs.wasted
    if wasted.pairs():
        state = "avoided by the prefetch guard" if costs.prefetch_guard else "included above"
        lines.append(
            f"  implicit-prefetch waste   {wasted.count()} all-gathers, "
            f"{format_bytes(wasted.bytes())} ({state})"
        )
    if costs.extra.pairs():
        lines.append(
            f"  outside FSDP units        {costs.extra.count()} all-reduce "
            "(runtime hooks, included above)"
        )
    lines.extend(f"  hook: {hook.format()}" for hook in costs.hooks)
    lines.extend(f"  note: {note}" for note in costs.notes)
    return "\n".join(lines)
