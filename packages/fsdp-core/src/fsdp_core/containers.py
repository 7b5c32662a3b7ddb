"""Layer containers: the ``nn.ModuleList`` / ``nn.ModuleDict`` whose items become FSDP units.

Not every dict of modules is a list of layers: adapter libraries keep per-adapter modules
in ``nn.ModuleDict`` objects beside the module they wrap (PEFT's ``lora_A`` / ``lora_B``
next to ``base_layer``, ``modules_to_save`` next to ``original_module``). Such a *branch
dict* ([`is_branch_dict`][fsdp_core.containers.is_branch_dict]) belongs to its holder and
its items never become units. ``nn.ModuleList`` objects are always layer lists.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = [
    "is_module_container",
    "is_branch_dict",
    "is_layer_container",
    "container_items",
    "iter_layer_items",
    "join_path",
    "is_under",
    "unwrap_module",
    "module_spans",
]

#: Attributes under which wrappers keep the module they wrap: torch's activation
#: checkpointing (``checkpoint_wrapper``) and ``torch.compile`` (``OptimizedModule``).
_WRAPPED_ATTRS = ("_checkpoint_wrapped_module", "_orig_mod")


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module inside activation-checkpoint and compile wrappers (any depth).

    Args:
        module: a module, possibly wrapped (``checkpoint_wrapper``, ``torch.compile``).

    Returns:
        The innermost wrapped module (``module`` itself when unwrapped).
    """
    for _ in range(16):
        inner = [w for a in _WRAPPED_ATTRS if isinstance(w := getattr(module, a, None), nn.Module)]
        if not inner:
            break
        module = inner[0]
    return module


def join_path(prefix: str, name: str) -> str:
    """Qualified name of ``name`` under ``prefix`` (the root's path is ``""``).

    Args:
        prefix: the parent's qualified name.
        name: the child's attribute name.

    Returns:
        ``prefix.name``, or ``name`` under the root.
    """
    return f"{prefix}.{name}" if prefix else name


def is_under(path: str, root: str) -> bool:
    """Whether the module or parameter at ``path`` is ``root`` or inside it (everything is
    inside ``""``): ``"vision.blocks.1"`` is under ``"vision"``, ``"vision_proj"`` is not.

    Args:
        path: a qualified module or parameter name.
        root: a qualified module name.

    Returns:
        Whether ``path`` is ``root`` or a descendant of it.
    """
    return root == "" or path == root or path.startswith(root + ".")


def is_module_container(module: nn.Module) -> bool:
    """Whether ``module`` is a list or dict of layers (``nn.Sequential`` is a layer, not one).

    Args:
        module: any module.

    Returns:
        Whether it is an ``nn.ModuleList`` or ``nn.ModuleDict``.
    """
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def is_branch_dict(container: nn.Module, parent: nn.Module) -> bool:
    """Whether ``container`` holds per-name branches of the one module ``parent`` wraps.

    True for an ``nn.ModuleDict`` when ``parent`` has exactly one child with parameters
    besides its dicts (the wrapped module) and every item is a leaf or a copy of it.

    Args:
        container: the candidate ``nn.ModuleDict``.
        parent: the module holding ``container``.

    Returns:
        Whether ``container`` is a branch dict of ``parent``.
    """
    if not isinstance(container, nn.ModuleDict) or len(container) == 0:
        return False
    wrapped = _wrapped_child(parent)
    if wrapped is None:
        return False
    kind = type(unwrap_module(wrapped))
    return all(
        _is_leaf(item) or isinstance(item, kind)
        for item in (unwrap_module(module) for module in container.children())
    )


def is_layer_container(module: nn.Module, parent: nn.Module | None = None) -> bool:
    """Whether ``module``'s items become units: a list or dict of layers, not a branch
    dict of ``parent`` (unknown when ``parent`` is None).

    Args:
        module: any module.
        parent: the module holding it, if known.

    Returns:
        Whether its items become units.
    """
    return is_module_container(module) and (parent is None or not is_branch_dict(module, parent))


def _is_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None


_DICTS = (nn.ModuleDict, nn.ParameterDict, nn.ParameterList)


def _wrapped_child(parent: nn.Module) -> nn.Module | None:
    """The one child of ``parent`` with parameters, dicts aside; None when not exactly one."""
    holders = [
        child
        for child in parent.children()
        if not isinstance(child, _DICTS) and next(child.parameters(), None) is not None
    ]
    return holders[0] if len(holders) == 1 else None


def container_items(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(key, item)`` pairs of a layer container, in registration order.

    Args:
        module: an ``nn.ModuleList`` or ``nn.ModuleDict``.

    Returns:
        Its ``(key, item)`` pairs.

    Raises:
        TypeError: ``module`` is not a layer container.
    """
    if not is_module_container(module):
        raise TypeError(f"{type(module).__name__} is not an nn.ModuleList or nn.ModuleDict")
    return [(str(key), item) for key, item in module.named_children()]


def iter_layer_items(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Every item of every layer container below ``module``, by qualified name.

    Containers are found at any depth outside items (an item's inner lists belong to its
    unit); containers nested directly in containers are flattened, and a container passed
    itself yields its own items. Branch dicts are searched like plain modules.

    Args:
        module: where to search (a container itself, or any module).
        prefix: ``module``'s qualified name in the model.

    Yields:
        ``(qualified name, item)`` for each leaf item.
    """
    yield from _walk(module, prefix, container=is_module_container(module))


def _walk(module: nn.Module, prefix: str, *, container: bool) -> Iterator[tuple[str, nn.Module]]:
    for key, child in container_items(module) if container else module.named_children():
        path = join_path(prefix, key)
        if is_layer_container(child, module):
            yield from _walk(child, path, container=True)
        elif container:
            yield path, child
        else:
            yield from _walk(child, path, container=False)


def module_spans(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Pre-order position and subtree end of every module (``named_modules`` order), so
    that "runs before" and "lies inside" are integer comparisons.

    Args:
        model: the model.

    Returns:
        ``{qualified name: (position, end)}``: a module lies inside another when its
        position is in the other's ``[position, end)``.
    """
    spans: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()

    def visit(path: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        start = len(seen) - 1
        for name, child in module.named_children():
            visit(join_path(path, name), child)
        spans[path] = (start, len(seen))

    visit("", model)
    return spans
