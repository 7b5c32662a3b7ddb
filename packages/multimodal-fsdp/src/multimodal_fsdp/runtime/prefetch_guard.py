"""Keep FSDP2's implicit backward prefetch off frozen units that run no backward.

In its pre-backward, every FSDP2 unit prefetches the unit that finished its
forward just before it. After a frozen vision tower that unit is the tower's
last unit (a block, or a group of norms): its inputs are pixels and its
parameters need no gradient, so its backward never runs, yet the prefetch
all-gathers it anyway, and the gathered parameters are only dropped at the end
of backward. One wasted all-gather (and the memory of one tower unit) per step.

[`guard_backward_prefetch`][multimodal_fsdp.runtime.prefetch_guard.guard_backward_prefetch] closes
that gap with
public FSDP2 API. Every non-root unit whose parameters are all frozen is marked
``set_unshard_in_backward(False)`` and is marked back as soon as one of its
forward outputs requires a gradient (then its own backward runs and needs its
parameters). A unit that no gradient reaches thus cannot be all-gathered in
backward, by prefetch or otherwise; any other unit behaves exactly as before.
The decision is made from what autograd sees, so it stays correct for frozen
units that gradients do pass through (frozen text layers, a frozen projector
behind a trainable tower).

Marks are only ever *added* until a backward has run: they are cleared at the
first grad-enabled forward after a backward. A no-grad forward between forward
and backward (a metric or reference pass), ``eval()`` and ``generate()`` between
steps, or two forwards before one backward therefore never take away a mark that
a pending backward still needs (allowing a gather is always safe; forbidding one
that a backward needs is not).

The decision is each rank's own, so it must not differ between ranks: a unit that
one rank all-gathers in backward and another does not desynchronises every later
collective. It differs when gradients reach a frozen unit on some ranks only: a
frozen decoder layer behind trainable code that runs only with media (LoRA in a
tower, a trainable projector or cross-attention layer) while another rank is
text-only. ``MultimodalParallelizer`` leaves such units out (the ``units`` of
``build_backward_prefetch_guard``); FSDP2's own prefetch then gathers them on
every rank.

[`MultimodalParallelizer`][multimodal_fsdp.parallelizer.MultimodalParallelizer] installs it after
sharding;
``remove_backward_prefetch_guard`` undoes it (used to show the difference).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
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

    Built on a sharded ``model`` from the frozen units to watch: (label, the unit's FSDP
    module, its member module paths) each.

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
                member = model.get_submodule(path) if path else model
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


def _frozen_units(model: nn.Module, plan: ShardingPlan) -> list[tuple[str, FSDPModule, list[str]]]:
    """(label, FSDP module, member paths) of every non-root unit whose parameters are all frozen."""
    found: list[tuple[str, FSDPModule, list[str]]] = []
    for label, paths in _frozen_plan_units(model, plan):
        first = model.get_submodule(paths[0]) if paths[0] else model
        if not isinstance(first, FSDPModule):
            logger.warning("unit %s is not an FSDP module; not guarded", label)
            continue
        found.append((label, first, paths))
    return found


def guard_backward_prefetch(model: nn.Module, plan: ShardingPlan) -> BackwardPrefetchGuard | None:
    """Stop backward all-gathers of frozen units that no gradient reaches (see module doc).

    ``model`` must already be sharded as ``plan`` says. Returns the guard, or
    ``None`` when the plan has no frozen unit besides the root. Calling it again
    on the same model returns the guard already installed. (The parallelizers
    install it themselves when their plan lists the ``prefetch_guard`` hook.)

    Args:
        model: the sharded model.
        plan: the plan it was sharded by.

    Returns:
        The guard, or None.

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

    ``units``: the labels of the frozen units to guard (default: every one). A unit
    that gradients reach on some ranks only must be left out (see the module doc).

    Args:
        model: the sharded model.
        plan: the plan it was sharded by.
        units: the labels to guard (every frozen unit when None).

    Returns:
        The guard, or None when no unit is guarded.
    """
    frozen = _frozen_units(model, plan)
    if units is not None:
        wanted = set(units)
        frozen = [entry for entry in frozen if entry[0] in wanted]
    return _install_guard(model, frozen)


def _install_guard(
    model: nn.Module, frozen: Sequence[tuple[str, FSDPModule, Sequence[str]]]
) -> BackwardPrefetchGuard | None:
    if not frozen:
        return None
    guard = BackwardPrefetchGuard(model, frozen)
    logger.info(
        "backward prefetch guarded for %d frozen units: %s", len(guard.units), list(guard.units)
    )
    return guard


@dataclass(frozen=True)
class PrefetchGuardRuntimeHook(RuntimeHook):
    """The ``prefetch_guard`` runtime hook; its plan data: the frozen units to guard, as
    (label, member module paths), decided at plan time."""

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
        watched = []
        for label, paths in self.units:
            first = model.get_submodule(paths[0]) if paths[0] else model
            if not isinstance(first, FSDPModule):
                logger.warning("unit %s is not an FSDP module; not guarded", label)
                continue
            watched.append((label, first, paths))
        return _install_guard(model, watched)


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
