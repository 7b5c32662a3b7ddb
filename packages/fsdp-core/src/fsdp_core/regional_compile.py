"""Per-block (regional) ``torch.compile`` of a sharded model, around the FSDP units.

Each block of a layer stack is compiled, as torchtitan does; a block's FSDP and runtime
hooks sit in its ``__call__``, outside its compiled ``forward``. A block with a unit
*inside* it (DeepSeek-V4.1's fp32 norm units) would break the graph at that unit's hooks,
so its pieces between the nested units are compiled instead and its own ``forward``
(residual additions) runs eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_core.containers import is_module_container, iter_layer_items, unwrap_module

__all__ = ["compile_blocks"]


def compile_blocks(
    model: nn.Module,
    *,
    backend: str = "inductor",
    fullgraph: bool = True,
    mode: str | None = None,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[str, ...]:
    """Compile the ``forward`` of every layer-stack item of ``model`` (its blocks), after
    the model is sharded, with the FSDP hooks left outside the compiled code.

    A block with a nested unit is compiled piecewise around it (see the module docstring).
    Call it once, after ``parallelize`` and activation checkpointing (looked through).
    Modules whose ``forward`` is already replaced on the instance are left as they are.

    Args:
        model: The sharded model.
        backend: ``torch.compile``'s backend.
        fullgraph: Raise on any graph break inside a compiled region (the default: the
            regions are chosen so that the library causes none).
        mode: ``torch.compile``'s mode.
        dynamic: ``torch.compile``'s dynamic-shape setting.
        options: ``torch.compile``'s backend options.

    Returns:
        The qualified names of the modules whose ``forward`` was compiled, in model order.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` has no layer stack (no block to compile).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    blocks = [block for _, block in iter_layer_items(model)]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no layer stack (nn.ModuleList/nn.ModuleDict of "
            "blocks): compile the model itself, or its blocks by hand"
        )
    names = {id(module): name for name, module in model.named_modules()}
    compiled: list[str] = []
    for block in blocks:
        for region in _regions(block):
            if "forward" in vars(region):
                continue  # already replaced (compiled before, or patched by the user)
            region.forward = torch.compile(
                region.forward,
                backend=backend,
                fullgraph=fullgraph,
                mode=mode,
                dynamic=dynamic,
                options=options,
            )
            compiled.append(names.get(id(region), type(region).__name__))
    return tuple(compiled)


def _regions(module: nn.Module) -> Iterator[nn.Module]:
    """The modules to compile for ``module``: the module inside its wrappers when no unit
    lies inside it, else the same for each of its children (a layer list's items, a
    parameter-free child skipped: compiling it alone gains nothing)."""
    inner = unwrap_module(module)
    nested = any(isinstance(sub, FSDPModule) for sub in inner.modules() if sub is not inner)
    if not nested and not is_module_container(inner):
        if next(inner.parameters(), None) is not None:
            yield inner
        return
    for child in inner.children():
        yield from _regions(child)
