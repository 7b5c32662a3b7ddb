"""Sharding plans as data: which modules become FSDP units, with which settings.

A plan is built without a process group or touching the model, so it can be printed,
compared and costed before a job starts; applying it is a separate step
([`apply_plan`][fsdp_core.parallelizer.ModelParallelizer.apply_plan]).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_core.module_tree import ModuleTreeFingerprint
from fsdp_core.runtime import HookPlan

__all__ = [
    "UnitPlan",
    "ShardCall",
    "ShardingPlan",
    "unit_parameters",
    "format_policy",
    "format_offload",
]

ROOT_LABEL = "<root>"

_Record = TypeVar("_Record")


@dataclass(frozen=True)
class UnitPlan:
    """One FSDP unit: its member modules (one, or several sharing one all-gather)."""

    paths: tuple[str, ...]
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int | None = None
    ignored_param_names: tuple[str, ...] = ()
    role: str = "layer"
    #: Where the unit's sharded state lives between uses (``CPUOffloadPolicy``: host
    #: memory); ``None``: the device, unless ``apply_plan(offload_policy=...)`` says otherwise.
    offload_policy: OffloadPolicy | None = None

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("a unit needs at least one module path")

    @property
    def label(self) -> str:
        """Short readable name: the path, or the common prefix and count for groups."""
        if len(self.paths) == 1:
            return self.paths[0] or ROOT_LABEL
        head = self.paths[0].split(".")[0] or ROOT_LABEL
        return f"{head}[{len(self.paths)} modules]"

    @property
    def is_root(self) -> bool:
        return self.paths == ("",)


@dataclass(frozen=True)
class ShardCall:
    """One call of torch's ``fully_shard`` (one module, or a group in one unit) and the
    units it creates."""

    paths: tuple[str, ...]
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int | None
    ignored_param_names: tuple[str, ...]
    units: tuple[UnitPlan, ...]
    #: The offload policy the call passes to ``fully_shard`` (its units' own).
    offload_policy: OffloadPolicy | None = None

    @property
    def is_group(self) -> bool:
        return len(self.paths) > 1


@dataclass(frozen=True)
class ShardingPlan:
    """The ordered calls (children before parents) and the units they produce."""

    calls: tuple[ShardCall, ...]
    ignored_param_names: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: Ignored parameters the parallelizer keeps whole on every rank itself.
    replicated_param_names: tuple[str, ...] = ()
    #: The runtime hooks applying the plan installs after sharding (see fsdp_core.runtime).
    hooks: tuple[HookPlan, ...] = ()
    # The fields below are not part of plan equality; plans built by hand leave them out.
    #: The module tree the plan was made for (``apply_plan`` refuses a model that differs).
    fingerprint: ModuleTreeFingerprint | None = field(default=None, compare=False, repr=False)
    #: Each replicated parameter's dtype once applied, as the planner decided it.
    replicated_param_dtypes: tuple[tuple[str, torch.dtype], ...] = field(
        default=(), compare=False, repr=False
    )
    #: Module paths no gradient reaches in a step, as the planner judged them (estimates).
    backward_free_paths: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    #: Whether applying broadcasts the replicated parameters from rank 0.
    sync_replicated: bool = field(default=True, compare=False, repr=False)
    #: Frozen dataclasses of the planner's own package that later stages read (a multimodal
    #: planner's towers and media regions), found with
    #: [`record`][fsdp_core.plan.ShardingPlan.record]; core does not read them.
    records: tuple[object, ...] = field(default=(), compare=False, repr=False)

    def record(self, kind: type[_Record]) -> _Record | None:
        """The planner's record of type ``kind``, if the plan has one.

        Args:
            kind: the record's class (``MultimodalRecord``, ...).

        Returns:
            The record, or None.
        """
        return next((r for r in self.records if isinstance(r, kind)), None)

    def hook_names(self) -> tuple[str, ...]:
        """The planned runtime hooks' names, in install order.

        Returns:
            The names.
        """
        return tuple(hook.name for hook in self.hooks)

    def hook(self, name: str) -> HookPlan | None:
        """The planned hook called ``name``, if any.

        Args:
            name: a hook name (``"unused_params"``, ...).

        Returns:
            Its plan entry, or None.
        """
        return next((hook for hook in self.hooks if hook.name == name), None)

    @property
    def units(self) -> tuple[UnitPlan, ...]:
        return tuple(unit for call in self.calls for unit in call.units)

    def unit_labels(self) -> list[str]:
        """Each unit's label (its member paths), in plan order: what tests and notes compare.

        Returns:
            The labels.
        """
        return [unit.label for unit in self.units]

    def role_counts(self) -> dict[str, int]:
        """How many units of each role (``"layer"``, ``"root"``, ``"dtype-island"``, ...).

        Returns:
            ``{role: count}``.
        """
        return dict(Counter(unit.role for unit in self.units))

    def format(self, model: nn.Module | None = None) -> str:
        """A readable table of units; with ``model`` also parameter counts and dtypes.

        Args:
            model: the planned model, for parameter counts and dtypes.

        Returns:
            The table.
        """
        owned = unit_parameters(self, model) if model is not None else None
        lines = [f"{len(self.units)} FSDP units"]
        for index, unit in enumerate(self.units):
            text = (
                f"  [{index:>3}] {unit.label:<40} {unit.role:<12} {format_policy(unit.mp_policy)}"
            )
            if unit.reshard_after_forward is not None:
                text += f" reshard={unit.reshard_after_forward}"
            if unit.offload_policy is not None:
                text += f" offload={format_offload(unit.offload_policy)}"
            if owned is not None:
                params = owned[index]
                numel = sum(p.numel() for _, p in params)
                dtypes = ",".join(sorted({_short(p.dtype) for _, p in params})) or "-"
                frozen = all(not p.requires_grad for _, p in params) and bool(params)
                text += f" params={numel:,} dtype={dtypes}" + (" frozen" if frozen else "")
            lines.append(text)
        if self.ignored_param_names:
            lines.append(
                f"  ignored parameters: {len(self.ignored_param_names)}"
                f" ({len(self.replicated_param_names)} replicated by the parallelizer)"
            )
        lines.extend(f"  hook: {hook.format()}" for hook in self.hooks)
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _short(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def format_policy(policy: MixedPrecisionPolicy) -> str:
    """The policy in short dtype names, e.g. ``param=float32 reduce=float32 out=bfloat16``.

    Args:
        policy: a mixed-precision policy.

    Returns:
        The short text.
    """
    text = f"param={_short(policy.param_dtype)} reduce={_short(policy.reduce_dtype)}"
    if policy.output_dtype is not None:
        text += f" out={_short(policy.output_dtype)}"
    return text


def format_offload(policy: OffloadPolicy) -> str:
    """``cpu`` for a ``CPUOffloadPolicy`` (``cpu(unpinned)`` without pinned memory), else
    the policy's class name.

    Args:
        policy: an offload policy.

    Returns:
        The short text.
    """
    if isinstance(policy, CPUOffloadPolicy):
        return "cpu" if policy.pin_memory else "cpu(unpinned)"
    return type(policy).__name__


def unit_parameters(plan: ShardingPlan, model: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """For each unit (in plan order), the parameters it manages.

    A unit manages its members' parameters that no earlier unit took and that are not
    ignored, as ``fully_shard`` assigns them.

    Args:
        plan: the plan.
        model: the planned model.

    Returns:
        ``(name, parameter)`` per managed parameter, per unit.
    """
    ignored = set(plan.ignored_param_names)
    taken: set[int] = set()
    result: list[list[tuple[str, nn.Parameter]]] = []
    for unit in plan.units:
        params: list[tuple[str, nn.Parameter]] = []
        for path in unit.paths:
            module = model.get_submodule(path) if path else model
            for name, param in module.named_parameters(prefix=path):
                if id(param) in taken or name in ignored or name in unit.ignored_param_names:
                    continue
                taken.add(id(param))
                params.append((name, param))
        result.append(params)
    return result
