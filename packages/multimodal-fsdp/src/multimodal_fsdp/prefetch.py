"""Keep FSDP2's implicit backward prefetch off frozen units that run no backward.

In its pre-backward, every FSDP2 unit prefetches the unit that finished its
forward just before it. After a frozen vision tower that unit is the tower's
last unit (a block, or a group of norms): its inputs are pixels and its
parameters need no gradient, so its backward never runs, yet the prefetch
all-gathers it anyway, and the gathered parameters are only dropped at the end
of backward. One wasted all-gather (and the memory of one tower unit) per step.

:func:`guard_backward_prefetch` closes that gap with public FSDP2 API. Every
non-root unit whose parameters are all frozen is marked
``set_unshard_in_backward(False)`` when the root forward starts, and is marked
back as soon as one of its forward outputs requires a gradient (then its own
backward runs and needs its parameters). A unit that no gradient reaches thus
cannot be all-gathered in backward, by prefetch or otherwise; any other unit
behaves exactly as before. The decision is made per step from what autograd
sees, so it stays correct for frozen units that gradients do pass through
(frozen text layers, a frozen projector behind a trainable tower).

:class:`~multimodal_fsdp.MultimodalParallelizer` installs it after sharding;
:func:`remove_backward_prefetch_guard` undoes it (used to show the difference).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_core import ShardingPlan, unit_parameters

__all__ = [
    "BackwardPrefetchGuard",
    "backward_prefetch_guard",
    "guard_backward_prefetch",
    "remove_backward_prefetch_guard",
]

logger = logging.getLogger(__name__)

_GUARDS: weakref.WeakKeyDictionary[nn.Module, BackwardPrefetchGuard] = weakref.WeakKeyDictionary()


def _needs_grad(value: Any, depth: int = 0) -> bool:
    """Whether any tensor in a forward output requires a gradient (nested outputs too)."""
    if depth > 8:
        return False
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, Mapping):
        return any(_needs_grad(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_needs_grad(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(
            _needs_grad(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value)
        )
    return False


@dataclass
class BackwardPrefetchGuard:
    """The installed guard: which units it watches, and which ran a backward last step."""

    units: tuple[str, ...]
    _modules: list[FSDPModule] = field(default_factory=list, repr=False)
    _handles: list[RemovableHandle] = field(default_factory=list, repr=False)
    _needed: list[bool] = field(default_factory=list, repr=False)

    def _reset(self, *_: object) -> None:
        for index, module in enumerate(self._modules):
            if self._needed[index]:
                module.set_unshard_in_backward(False)
                self._needed[index] = False

    def _mark(self, index: int) -> None:
        if not self._needed[index]:
            self._modules[index].set_unshard_in_backward(True)
            self._needed[index] = True

    def blocked_units(self) -> list[str]:
        """Units that cannot be all-gathered in the current (or last) backward."""
        return [label for label, needed in zip(self.units, self._needed, strict=True) if not needed]

    def remove(self) -> None:
        """Remove the hooks and give every watched unit FSDP2's default behaviour back."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._modules:
            module.set_unshard_in_backward(True)
        self._needed = [True] * len(self._modules)


def _frozen_units(model: nn.Module, plan: ShardingPlan) -> list[tuple[str, FSDPModule, list[str]]]:
    """(label, FSDP module, member paths) of every non-root unit whose parameters are all frozen."""
    found: list[tuple[str, FSDPModule, list[str]]] = []
    for unit, params in zip(plan.units, unit_parameters(plan, model), strict=True):
        if unit.is_root or not params or any(p.requires_grad for _, p in params):
            continue
        first = model.get_submodule(unit.paths[0]) if unit.paths[0] else model
        if not isinstance(first, FSDPModule):
            logger.warning("unit %s is not an FSDP module; not guarded", unit.label)
            continue
        found.append((unit.label, first, list(unit.paths)))
    return found


def guard_backward_prefetch(model: nn.Module, plan: ShardingPlan) -> BackwardPrefetchGuard | None:
    """Stop backward all-gathers of frozen units that no gradient reaches (see module doc).

    ``model`` must already be sharded as ``plan`` says. Returns the guard, or
    ``None`` when the plan has no frozen unit besides the root. Calling it again
    on the same model returns the guard already installed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    existing = _GUARDS.get(model)
    if existing is not None:
        return existing
    frozen = _frozen_units(model, plan)
    if not frozen:
        return None
    guard = BackwardPrefetchGuard(units=tuple(label for label, _, _ in frozen))
    for index, (_, unit, paths) in enumerate(frozen):
        guard._modules.append(unit)
        guard._needed.append(True)

        def mark(_module: nn.Module, _args: Any, output: Any, index: int = index) -> None:
            if torch.is_grad_enabled() and _needs_grad(output):
                guard._mark(index)

        for path in paths:
            member = model.get_submodule(path) if path else model
            guard._handles.append(member.register_forward_hook(mark))
    guard._handles.append(model.register_forward_pre_hook(guard._reset))
    guard._reset()
    _GUARDS[model] = guard
    logger.info(
        "backward prefetch guarded for %d frozen units: %s", len(guard.units), list(guard.units)
    )
    return guard


def backward_prefetch_guard(model: nn.Module) -> BackwardPrefetchGuard | None:
    """The guard installed on ``model``, if any."""
    return _GUARDS.get(model)


def remove_backward_prefetch_guard(model: nn.Module) -> bool:
    """Undo :func:`guard_backward_prefetch` on ``model``; returns whether there was one."""
    guard = _GUARDS.pop(model, None)
    if guard is None:
        return False
    guard.remove()
    return True
