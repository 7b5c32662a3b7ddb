"""Keep FSDP2's implicit backward prefetch off frozen units that run no backward.

FSDP2 prefetches, in each unit's pre-backward, the unit that finished its forward just
before it: after a frozen tower that is the tower's last unit, whose backward never
runs, so one all-gather (and one unit's memory) per step is wasted.
[`guard_backward_prefetch`][multimodal_fsdp.runtime.prefetch_guard.guard_backward_prefetch]
marks every frozen non-root unit ``set_unshard_in_backward(False)`` and marks it back
as soon as one of its forward outputs requires a gradient, so the decision follows what
autograd sees. Marks are only added until a backward has run (a no-grad pass or
``generate()`` between forward and backward never takes one away a backward needs).

The decision must not differ between ranks: units that gradients reach on some ranks
only (behind trainable code that runs only with media) are left out by
``MultimodalParallelizer`` (the ``units`` of ``build_backward_prefetch_guard``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_core import ShardingPlan
from fsdp_core.internals import Probe
from fsdp_core.plan import unit_parameters
from fsdp_core.runtime import (
    BackwardWatch,
    RuntimeHook,
    installed_hooks,
    output_tensors,
    register_installed_hook,
    remove_runtime_hooks,
)

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = [
    "BackwardPrefetchGuard",
    "PrefetchGuardRuntimeHook",
    "backward_prefetch_guard",
    "build_backward_prefetch_guard",
    "frozen_unit_labels",
    "guard_backward_prefetch",
    "remove_backward_prefetch_guard",
]

logger = logging.getLogger(__name__)

NAME = "prefetch_guard"


class BackwardPrefetchGuard:
    """The installed guard: which units it watches, and which ran a backward last step.

    Args:
        model: the sharded model.
        watched: ``(label, FSDP module, member paths)`` per frozen unit.
    """

    name: str = NAME

    def __init__(
        self, model: nn.Module, watched: Sequence[tuple[str, FSDPModule, Sequence[str]]]
    ) -> None:
        self.units = tuple(label for label, _, _ in watched)
        self._modules = [unit for _, unit, _ in watched]
        self._needed = [True] * len(watched)
        self._handles: list[RemovableHandle] = []
        for index, (_, _, paths) in enumerate(watched):
            for path in paths:
                member = model.get_submodule(path)
                self._handles.append(member.register_forward_hook(self._mark_hook(index)))
        self._handles.append(model.register_forward_pre_hook(self._before_forward))
        self._watch: BackwardWatch | None = BackwardWatch(model, self._saw_backward)
        self._reset()
        self._backward_ran = False

    def _mark_hook(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def mark(_module: nn.Module, _args: Any, output: Any) -> None:
            if torch.is_grad_enabled() and output_tensors(output):
                self._mark(index)

        return mark

    def _saw_backward(self) -> None:
        self._backward_ran = True

    def _before_forward(self, *_: object) -> None:
        """Start a new step's marks, but only once the previous step's backward ran."""
        if torch.is_grad_enabled() and self._backward_ran:
            self._backward_ran = False
            self._reset()

    def _reset(self) -> None:
        for index, module in enumerate(self._modules):
            if self._needed[index]:
                module.set_unshard_in_backward(False)
                self._needed[index] = False

    def _mark(self, index: int) -> None:
        if not self._needed[index]:
            self._modules[index].set_unshard_in_backward(True)
            self._needed[index] = True

    def blocked_units(self) -> list[str]:
        """Units that cannot be all-gathered in the current (or last) backward.

        Returns:
            Their labels.
        """
        return [label for label, needed in zip(self.units, self._needed, strict=True) if not needed]

    def remove(self) -> None:
        """Remove the hooks and give every watched unit FSDP2's default behaviour back."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        for module in self._modules:
            module.set_unshard_in_backward(True)
        self._needed = [True] * len(self._modules)


def frozen_unit_labels(model: nn.Module, plan: ShardingPlan) -> list[str]:
    """Labels of the non-root units of ``plan`` whose parameters are all frozen (the
    units the guard watches); needs no process group.

    Args:
        model: the sharded model.
        plan: the plan it was sharded by.

    Returns:
        The labels.
    """
    return [label for label, _ in _frozen_plan_units(model, plan)]


def _frozen_plan_units(model: nn.Module, plan: ShardingPlan) -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    for unit, params in zip(plan.units, unit_parameters(plan, model), strict=True):
        if unit.is_root or not params or any(p.requires_grad for _, p in params):
            continue
        found.append((unit.label, list(unit.paths)))
    return found


def guard_backward_prefetch(model: nn.Module, plan: ShardingPlan) -> BackwardPrefetchGuard | None:
    """Stop backward all-gathers of frozen units that no gradient reaches (see module doc).

    Calling it again on the same model returns the guard already installed.

    Args:
        model: the sharded model.
        plan: the plan it was sharded by.

    Returns:
        The guard, or None when the plan has no frozen non-root unit.

    Raises:
        TypeError: ``model`` or ``plan`` has the wrong type.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    existing = backward_prefetch_guard(model)
    if existing is not None:
        return existing
    guard = build_backward_prefetch_guard(model, plan)
    if guard is not None:
        register_installed_hook(model, guard)
    return guard


def build_backward_prefetch_guard(
    model: nn.Module, plan: ShardingPlan, *, units: Collection[str] | None = None
) -> BackwardPrefetchGuard | None:
    """Install the guard's hooks and return it, without recording it on the model.

    Args:
        model: the sharded model.
        plan: the plan it was sharded by.
        units: the labels to guard (every frozen unit when None); leave out units that
            gradients reach on some ranks only.

    Returns:
        The guard, or None when no unit is guarded.
    """
    frozen = _frozen_plan_units(model, plan)
    if units is not None:
        wanted = set(units)
        frozen = [entry for entry in frozen if entry[0] in wanted]
    return _install_guard(model, frozen)


def _install_guard(
    model: nn.Module, units: Iterable[tuple[str, Sequence[str]]]
) -> BackwardPrefetchGuard | None:
    """The guard on the units' FSDP modules (a unit that is none is warned about)."""
    watched = []
    for label, paths in units:
        first = model.get_submodule(paths[0])
        if not isinstance(first, FSDPModule):
            logger.warning("unit %s is not an FSDP module; not guarded", label)
            continue
        watched.append((label, first, paths))
    if not watched:
        return None
    guard = BackwardPrefetchGuard(model, watched)
    logger.info(
        "backward prefetch guarded for %d frozen units: %s", len(guard.units), list(guard.units)
    )
    return guard


@dataclass(frozen=True)
class PrefetchGuardRuntimeHook(RuntimeHook):
    """The ``prefetch_guard`` runtime hook; plan data: (label, member paths) per unit."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[Probe, ...]] = ()

    units: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def from_plan(
        cls, model: nn.Module, plan: ShardingPlan, labels: Collection[str]
    ) -> PrefetchGuardRuntimeHook:
        """The hook guarding the frozen units of ``plan`` named in ``labels``.

        Args:
            model: the model (meta is enough).
            plan: the plan it was sharded by.
            labels: the frozen units to guard.

        Returns:
            The hook with its plan data.
        """
        wanted = set(labels)
        return cls(
            tuple(
                (label, tuple(paths))
                for label, paths in _frozen_plan_units(model, plan)
                if label in wanted
            )
        )

    def install(self, model: nn.Module, *, dims: ParallelDims) -> BackwardPrefetchGuard | None:
        return _install_guard(model, self.units)


def backward_prefetch_guard(model: nn.Module) -> BackwardPrefetchGuard | None:
    """The guard installed on ``model``, if any.

    Args:
        model: the sharded model.

    Returns:
        The guard, or None.
    """
    guard = installed_hooks(model).get(NAME)
    return guard if isinstance(guard, BackwardPrefetchGuard) else None


def remove_backward_prefetch_guard(model: nn.Module) -> bool:
    """Undo ``guard_backward_prefetch`` on ``model``; returns whether there was one.

    Args:
        model: the sharded model.

    Returns:
        Whether a guard was removed.
    """
    return bool(remove_runtime_hooks(model, [NAME]))
