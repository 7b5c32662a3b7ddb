"""Make gradient accumulation and unused parameters safe across ranks.

Two FSDP2 behaviours (torch 2.13) break real VLM training:

- A unit whose parameters were never unsharded (say, a vision tower that has
  not yet seen an image) crashes the first non-syncing backward with
  ``'FSDPParam' object has no attribute '_unsharded_param'`` when FSDP's
  final callback tries to stash its gradient. :func:`install_unshard_warmup`
  unshards and reshards such units once, before that forward, on every rank.
- A unit reduce-scatters only the parameters that received a gradient, so
  ranks whose batch skipped part of a unit (a text-only batch and a projector
  inside the root unit) issue reduce-scatters of different sizes.
  ``set_reduce_scatter_unused_params(True)`` makes them send zeros instead.
- With a reduce dtype (bf16 compute, fp32 reduction), a non-syncing backward
  stores fp32 "accumulated" gradients only for the parameters it reached. A
  parameter first reached later (the projector in the root unit, first used
  by the image micro-batch after a text-only one) then reaches the
  reduce-scatter with a bf16 gradient beside fp32 ones, and FSDP stops with
  ``reduce-scatter expects uniform gradient dtype``. The same pre-forward hook
  gives such parameters a zero fp32 accumulated gradient, so every gradient of
  the unit is accumulated in the reduce dtype.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_core import compat

__all__ = ["install_unshard_warmup", "reduce_scatter_unused_params", "make_accumulation_safe"]

logger = logging.getLogger(__name__)

_WARMUP_ATTR = "_fsdp_core_unshard_warmup"


def _units(root: nn.Module) -> list[FSDPModule]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def reduce_scatter_unused_params(root: nn.Module, enabled: bool = True) -> int:
    """Set ``set_reduce_scatter_unused_params`` on every unit; returns how many."""
    if not compat.REDUCE_SCATTER_UNUSED_PARAMS:
        logger.warning(
            "this torch cannot reduce-scatter unused parameters; ranks that skip part of "
            "a unit may disagree on reduce-scatter sizes"
        )
        return 0
    units = _units(root)
    for unit in units:
        unit.set_reduce_scatter_unused_params(enabled, recurse=False)
    return len(units)


def _never_unsharded(unit: FSDPModule) -> bool:
    """Reads FSDP2 internals (torch 2.13); on a torch without them, never warms up."""
    try:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None or group.reduce_grads:
            return False
        return any(not hasattr(param, "_unsharded_param") for param in group.fsdp_params)
    except AttributeError:
        return False


def _align_accumulated_grads(unit: FSDPModule) -> bool:
    """Give trainable parameters without an accumulated gradient a zero one, in units
    where a non-syncing backward already accumulated some. Returns whether it did."""
    try:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None:
            return False
        params = [p for p in group.fsdp_params if hasattr(p, "_unsharded_param")]
        if not any(p.unsharded_accumulated_grad is not None for p in params):
            return False
        changed = False
        for param in params:
            unsharded = param._unsharded_param
            if param.unsharded_accumulated_grad is not None or not unsharded.requires_grad:
                continue
            reduce_dtype = param.reduce_dtype or unsharded.dtype
            if unsharded.grad is not None:
                param.unsharded_accumulated_grad = unsharded.grad.to(reduce_dtype)
                unsharded.grad = None
            else:
                param.unsharded_accumulated_grad = torch.zeros_like(unsharded, dtype=reduce_dtype)
            changed = True
        return changed
    except AttributeError:
        return False


def install_unshard_warmup(root: nn.Module) -> None:
    """Before each forward of ``root``, warm up units a non-syncing backward would trip on.

    Only units that are not syncing gradients and were never unsharded are
    touched, so ordinary steps issue no extra collective; with gradient
    accumulation each such unit costs one all-gather, once per run. Every rank
    sees the same sync flags and history, so all ranks warm up the same units.
    """
    if getattr(root, _WARMUP_ATTR, False):
        return

    def warm_up(module: nn.Module, args: Any, kwargs: Any) -> None:
        units = _units(module)
        pending = [unit for unit in units if _never_unsharded(unit)]
        for unit in pending:
            unit.unshard()
            unit.reshard()
        if pending:
            logger.info("warmed up %d FSDP units before a non-syncing step", len(pending))
        aligned = sum(_align_accumulated_grads(unit) for unit in units)
        if aligned:
            logger.debug("aligned accumulated gradients of %d units", aligned)

    root.register_forward_pre_hook(warm_up, prepend=True, with_kwargs=True)
    setattr(root, _WARMUP_ATTR, True)


def make_accumulation_safe(root: nn.Module) -> None:
    """Both measures above on a sharded model (idempotent)."""
    reduce_scatter_unused_params(root)
    install_unshard_warmup(root)
