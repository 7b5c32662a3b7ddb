"""Layer-container sharding: each ``nn.ModuleList`` / ``nn.ModuleDict`` item is a unit."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fsdp_core.containers import is_module_container, iter_layer_items

__all__ = [
    "multimodal_unit_paths",
    "shard_multimodal_module",
    "_container_items",
    "_is_module_container",
    "_shard_layer_containers_recursively",
]


def _is_module_container(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.ModuleList`` or ``nn.ModuleDict`` of layers.

    Args:
        module: any module.

    Returns:
        Whether it is a layer container.
    """
    return is_module_container(module)


def _container_items(module: nn.Module) -> list[tuple[object, nn.Module]]:
    """``(key, item)`` pairs of any module, as the reference enumerates them.

    An ``nn.ModuleDict`` gives its ``str`` keys; every other module is enumerated
    with ``int`` positions: a list or ``nn.Sequential`` in iteration order (an
    item registered twice appears twice), any other module over its children.

    Args:
        module: any module.

    Returns:
        Its ``(key, item)`` pairs.
    """
    if isinstance(module, nn.ModuleDict):
        return list(module.items())
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return list(enumerate(module))
    return list(enumerate(module.children()))


def _shard_layer_containers_recursively(
    module: nn.Module, shard_module: Callable[[nn.Module], object]
) -> bool:
    """Call ``shard_module`` on every leaf item of every container below ``module``.

    Containers are searched at any depth outside items; lists nested directly
    in lists are flattened, and items are not searched further (their inner
    lists belong to their unit). Adapter dicts beside the module they adapt
    ([`fsdp_core.containers.is_branch_dict`][fsdp_core.containers.is_branch_dict]) are no
    containers. Returns whether anything was sharded. The walk is
    [`fsdp_core.containers.iter_layer_items`][fsdp_core.containers.iter_layer_items], the one
    the planner uses.

    Args:
        module: where to search.
        shard_module: called on each leaf item.

    Returns:
        Whether ``shard_module`` was called at all.
    """
    seen: set[int] = set()
    for _, item in iter_layer_items(module):
        if id(item) not in seen:  # a layer registered in two containers is one unit
            seen.add(id(item))
            shard_module(item)
    return bool(seen)


def multimodal_unit_paths(model: nn.Module, path: str = "") -> list[str]:
    """The units of the module at ``path`` of ``model`` at layer-container granularity:
    the paths (as ``model.named_modules()`` names them) of the leaf items of its
    containers, each once, or ``[path]`` when it has none. What the planner makes units
    of, and what [`shard_multimodal_module`][multimodal_fsdp.layers.shard_multimodal_module]
    shards.

    Args:
        model: the model.
        path: the module's qualified name (``""`` for ``model``).

    Returns:
        The unit paths.
    """
    module = model.get_submodule(path) if path else model
    names = {id(sub): name for name, sub in model.named_modules()}
    seen: set[int] = set()
    paths: list[str] = []
    for _, item in iter_layer_items(module):
        if id(item) not in seen:  # a layer registered in two containers is one unit
            seen.add(id(item))
            paths.append(names[id(item)])
    return paths or [path]


def shard_multimodal_module(module: nn.Module, shard_module: Callable[[nn.Module], object]) -> None:
    """Shard ``module`` at layer-container granularity, or whole when it has no containers:
    ``shard_module`` is called on each unit
    [`multimodal_unit_paths`][multimodal_fsdp.layers.multimodal_unit_paths] names, in order.

    Args:
        module: a tower, projector or any module.
        shard_module: shards one module (``fully_shard`` with the caller's options).

    Raises:
        TypeError: ``module`` is not a module or ``shard_module`` not callable.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not callable(shard_module):
        raise TypeError(f"shard_module must be callable, got {type(shard_module).__name__}")
    for path in multimodal_unit_paths(module):
        shard_module(module.get_submodule(path) if path else module)
