"""Layer containers: the ``nn.ModuleList`` / ``nn.ModuleDict`` whose items become FSDP units."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = [
    "is_module_container",
    "container_items",
    "iter_layer_items",
    "join_path",
    "unwrap_module",
]

#: Attributes under which wrappers keep the module they wrap: torch's activation
#: checkpointing (``checkpoint_wrapper``) and ``torch.compile`` (``OptimizedModule``).
_WRAPPED_ATTRS = ("_checkpoint_wrapped_module", "_orig_mod")


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module inside activation-checkpoint and compile wrappers (any depth)."""
    for _ in range(16):
        inner = next(
            (
                wrapped
                for attr in _WRAPPED_ATTRS
                if isinstance(wrapped := getattr(module, attr, None), nn.Module)
            ),
            None,
        )
        if inner is None:
            break
        module = inner
    return module


def join_path(prefix: str, name: str) -> str:
    """Qualified name of ``name`` under ``prefix`` (the root's path is ``""``)."""
    return f"{prefix}.{name}" if prefix else name


def is_module_container(module: nn.Module) -> bool:
    """Whether ``module`` is a list or dict of layers (``nn.Sequential`` is a layer, not one)."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def container_items(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(key, item)`` pairs of a layer container, in registration order."""
    if not is_module_container(module):
        raise TypeError(f"{type(module).__name__} is not an nn.ModuleList or nn.ModuleDict")
    return [(str(key), item) for key, item in module.named_children()]


def iter_layer_items(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Every item of every layer container below ``module``, by qualified name.

    Containers are found at any depth outside items; an item is not searched
    further (its inner lists belong to its unit), except that containers nested
    directly in containers are flattened so every leaf item is yielded. A
    container passed itself yields its own items.
    """
    if is_module_container(module):
        yield from _iter_container(module, prefix)
        return
    for name, child in module.named_children():
        path = join_path(prefix, name)
        if is_module_container(child):
            yield from _iter_container(child, path)
        else:
            yield from iter_layer_items(child, path)


def _iter_container(container: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    for key, item in container_items(container):
        path = join_path(prefix, key)
        if is_module_container(item):
            yield from _iter_container(item, path)
        else:
            yield path, item
