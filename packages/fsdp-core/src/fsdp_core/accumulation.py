"""Make gradient accumulation safe when some units have not run yet.

A pre-forward hook on the root
([`install_unshard_warmup`][fsdp_core.accumulation.install_unshard_warmup]) works around
two FSDP2 failures (torch 2.13) of non-syncing backwards, on every rank:

- a unit never unsharded (a tower that saw no image yet) fails with ``'FSDPParam' object
  has no attribute '_unsharded_param'``: it is unsharded and resharded once;
- with a reduce dtype, a parameter first reached after a non-syncing backward fails with
  ``reduce-scatter expects uniform gradient dtype``: it gets a zero accumulated gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_core import internals
from fsdp_core.runtime import RuntimeHook

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = ["AccumulationWarmup", "AccumulationWarmupRuntimeHook", "install_unshard_warmup"]

logger = logging.getLogger(__name__)

NAME = "accumulation_warmup"


def _align_accumulated_grads(unit: FSDPModule) -> bool:
    """Give trainable parameters without an accumulated gradient a zero one (or their
    gradient) where a non-syncing backward accumulated some; whether it did."""
    gathered = [
        (param, unsharded)
        for param in internals.fsdp_params(unit)
        if (unsharded := internals.unsharded_parameter(param)) is not None
    ]
    if not any(internals.accumulated_gradient(param) is not None for param, _ in gathered):
        return False
    changed = False
    for param, unsharded in gathered:
        if internals.accumulated_gradient(param) is not None or not unsharded.requires_grad:
            continue
        dtype = internals.reduce_dtype(param) or unsharded.dtype
        if unsharded.grad is not None:
            internals.set_accumulated_gradient(param, unsharded.grad.to(dtype))
            unsharded.grad = None
        else:
            internals.set_accumulated_gradient(param, torch.zeros_like(unsharded, dtype=dtype))
        changed = True
    return changed


class AccumulationWarmup:
    """The installed warm-up: a forward pre-hook on ``root``, registered on construction.

    Args:
        root: the sharded model's root unit.
    """

    name: str = NAME

    def __init__(self, root: nn.Module) -> None:
        self._handle: RemovableHandle | None = root.register_forward_pre_hook(
            self._before_forward, prepend=True, with_kwargs=True
        )
        #: How many units the last forward warmed up, and aligned.
        self.last_warmed = 0
        self.last_aligned = 0

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        units = internals.distinct_units(module)
        pending = [unit for unit in units if internals.never_unsharded(unit)]
        for unit in pending:
            unit.unshard()
            unit.reshard()
        if pending:
            logger.info("warmed up %d FSDP units before a non-syncing step", len(pending))
        self.last_warmed = len(pending)
        self.last_aligned = sum(_align_accumulated_grads(unit) for unit in units)
        if self.last_aligned:
            logger.debug("aligned accumulated gradients of %d units", self.last_aligned)

    def remove(self) -> None:
        """Remove the forward pre-hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def install_unshard_warmup(root: nn.Module) -> AccumulationWarmup:
    """Before each forward of ``root``, warm up units a non-syncing backward would trip on
    (one all-gather per never-unsharded unit, once per run).

    Args:
        root: the sharded model's root unit.

    Returns:
        The installed warm-up.
    """
    return AccumulationWarmup(root)


@dataclass(frozen=True)
class AccumulationWarmupRuntimeHook(RuntimeHook):
    """The ``accumulation_warmup`` runtime hook (no plan data)."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[internals.Probe, ...]] = (
        internals.STATE_GROUPS,
        internals.GROUP_PARAMS,
        internals.GROUP_REDUCE,
        internals.PARAM_UNSHARDED,
        internals.PARAM_ACCUMULATED,
        internals.PARAM_REDUCE_DTYPE,
    )

    def install(self, model: nn.Module, *, dims: ParallelDims) -> AccumulationWarmup:
        return AccumulationWarmup(model)
