"""The same reduce-scatter order on every rank, whatever each rank's inputs need.

FSDP2 reduces a unit right after its backward when one of its inputs requires a
gradient, else at the end of the backward. LoRA in a tower that runs on some ranks only
makes the first decoder layer's input require one on those ranks alone, and the ranks'
reduce-scatters of different units meet (gloo size mismatch, NCCL hang).
``make_unit_inputs_require_grad`` routes one input of every non-root trainable unit (its
activations: ``hidden_states``, else the first floating positional one, never a mask)
through a no-op autograd function tied to a leaf, so every rank reduces it early.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeGuard

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_core import internals

__all__ = ["make_unit_inputs_require_grad"]


#: The keyword under which transformers' layers take their activations.
HIDDEN_STATES = "hidden_states"


class _TiedToLeaf(torch.autograd.Function):
    """``x`` unchanged, but part of the graph through ``leaf`` (which gets no gradient)."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # A view, as FSDP's own input hook returns: no copy.
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


def _floating(value: object) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


class _InputGradHook:
    """The forward pre-hook of one unit's modules."""

    def __init__(self) -> None:
        self._leaves: dict[torch.device, torch.Tensor] = {}

    def __call__(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not torch.is_grad_enabled():
            return None  # no backward to order
        # An activation-checkpoint recompute is routed too: it must save what the
        # forward saved, and FSDP treats it like a forward whose inputs need grad.
        if _any_requires_grad(args, kwargs):
            return None  # FSDP hooks these inputs itself
        hidden = kwargs.get(HIDDEN_STATES)
        if _floating(hidden):
            return args, {**kwargs, HIDDEN_STATES: self._requiring_grad(hidden)}
        for index, value in enumerate(args):
            if _floating(value):
                return (*args[:index], self._requiring_grad(value), *args[index + 1 :]), kwargs
        return None

    def _requiring_grad(self, value: torch.Tensor) -> torch.Tensor:
        leaf = self._leaves.get(value.device)
        if leaf is None:
            leaf = torch.zeros((), device=value.device, requires_grad=True)
            self._leaves[value.device] = leaf
        routed: torch.Tensor = _TiedToLeaf.apply(leaf, value)  # type: ignore[no-untyped-call]
        return routed


def _any_requires_grad(*values: object) -> bool:
    """Whether a tensor in ``values`` (nested in tuples, lists and dicts) requires grad."""
    for value in values:
        if isinstance(value, dict):
            value = tuple(value.values())
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return True
        if isinstance(value, (tuple, list)) and _any_requires_grad(*value):
            return True
    return False


def make_unit_inputs_require_grad(
    model: nn.Module, units: Iterable[FSDPModule]
) -> list[RemovableHandle]:
    """Make one input of every non-root trainable unit of ``units`` require a gradient;
    the handles remove the hooks."""
    handles: list[RemovableHandle] = []
    for unit in units:
        modules = internals.unit_modules(unit)
        trainable = any(
            internals.sharded_parameter(p).requires_grad for p in internals.fsdp_params(unit)
        )
        if not trainable or any(module is model for module in modules):
            continue
        hook = _InputGradHook()
        for module in modules:
            # prepend: run before FSDP's pre-forward, which hooks the inputs it is given.
            handles.append(module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))
    return handles
