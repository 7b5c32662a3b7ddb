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
    """``(key, item)`` pairs of any module, as the reference enumerates them: ``str`` keys
    of an ``nn.ModuleDict``, else ``int`` positions (over the children of a non-list).

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
    """Call ``shard_module`` on every leaf item of every container below ``module``, each
    once (the planner's walk,
    [`iter_layer_items`][fsdp_core.containers.iter_layer_items]).

    Args:
        module: where to search.
        shard_module: called on each leaf item.

    Returns:
        Whether ``shard_module`` was called at all.
    """
    items = _unique_items(module)
    for item in items:
        shard_module(item)
    return bool(items)


def _unique_items(module: nn.Module) -> list[nn.Module]:
    """The leaf items of ``module``'s containers, each once (a layer registered in two
    containers is one unit)."""
    return list({id(item): item for _, item in iter_layer_items(module)}.values())


def multimodal_unit_paths(model: nn.Module, path: str = "") -> list[str]:
    """The units of the module at ``path`` at layer-container granularity: the paths of
    the leaf items of its containers, each once, or ``[path]`` when it has none.

    Args:
        model: the model.
        path: the module's qualified name (``""`` for ``model``).

    Returns:
        The unit paths.
    """
    names = {id(sub): name for name, sub in model.named_modules()}
    return [names[id(item)] for item in _unique_items(model.get_submodule(path))] or [path]


def shard_multimodal_module(module: nn.Module, shard_module: Callable[[nn.Module], object]) -> None:
    """Shard ``module`` at layer-container granularity, or whole when it has no containers
    (the units of [`multimodal_unit_paths`][multimodal_fsdp.layers.multimodal_unit_paths]).

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
        shard_module(module.get_submodule(path))
