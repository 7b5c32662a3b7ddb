"""Stop an optimizer that was built before sharding at its first step.

``fully_shard`` replaces every parameter it manages, so an optimizer built before holds
tensors the model no longer uses and training silently does nothing. Applying a plan
tags each replaced parameter, and a global optimizer step pre-hook raises
``StaleOptimizerError`` (on every rank: each built the same optimizer) when an optimizer
holds one. Each optimizer is scanned again only when its parameter groups change or
more parameters were replaced since.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdp_core.rank_wait import names_text

__all__ = ["StaleOptimizerError", "mark_replaced_parameters"]

#: Attribute set on a parameter that sharding replaced: its qualified name.
_TAG = "_fsdp_core_replaced_by_sharding"
_LIMIT = 5


class StaleOptimizerError(RuntimeError):
    """An optimizer holds parameters that sharding replaced (it was built too early)."""


@dataclass
class _State:
    generation: int = 0
    scans: int = 0
    handle: RemovableHandle | None = None
    #: optimizer -> (generation, number of parameter groups) it was last found clean at.
    checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = field(
        default_factory=weakref.WeakKeyDictionary
    )


_STATE = _State()


def mark_replaced_parameters(
    model: nn.Module, before: Mapping[str, nn.Parameter]
) -> tuple[str, ...]:
    """Tag the parameters of ``before`` (name -> parameter, taken before sharding) that
    ``model`` no longer holds, and install the optimizer check; returns their names.

    Args:
        model: the sharded model.
        before: its parameters by name, taken before sharding.

    Returns:
        The names of the parameters sharding replaced.
    """
    now = {id(p) for p in model.parameters()}
    replaced = [name for name, param in before.items() if id(param) not in now]
    for name in replaced:
        setattr(before[name], _TAG, name)
    if replaced:
        _STATE.generation += 1
        if _STATE.handle is None:  # one global optimizer step pre-hook per process
            _STATE.handle = register_optimizer_step_pre_hook(_before_step)
    return tuple(replaced)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Raise ``StaleOptimizerError`` if ``optimizer`` holds a parameter sharding replaced."""
    key = (_STATE.generation, len(optimizer.param_groups))
    if _STATE.checked.get(optimizer) == key:
        return
    _STATE.scans += 1
    params = (p for group in optimizer.param_groups for p in group["params"])
    stale = [tag for p in params if isinstance(tag := getattr(p, _TAG, None), str)]
    if not stale:
        _STATE.checked[optimizer] = key
        return
    raise StaleOptimizerError(
        f"{type(optimizer).__name__} was built before the model was sharded: it holds "
        f"{len(stale)} parameters that sharding replaced ({names_text(stale, _LIMIT)}), so "
        "its steps would update tensors the model no longer uses and training would "
        "silently do nothing; build the optimizer after parallelize (or apply_plan) and "
        "after loading weights: optimizer = torch.optim.AdamW(model.parameters(), ...)."
    )
