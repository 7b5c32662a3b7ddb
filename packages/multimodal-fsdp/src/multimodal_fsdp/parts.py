"""How a multimodal module splits into the pieces the frozen-tower policy acts on: its
maximal fully frozen and fully trainable submodules, and for a partly trainable module
(LoRA in frozen blocks) each layer as *frozen*, *trainable* or *adapted*.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torch import nn

from fsdp_core.containers import iter_layer_items, join_path
from fsdp_core.rank_wait import names_text
from multimodal_fsdp.discovery.names import MultimodalModule
from multimodal_fsdp.policy import frozen_policy

__all__ = [
    "LayerKind",
    "MultimodalParts",
    "classify_layers",
    "layer_kind",
    "partly_trainable_note",
    "split_frozen_parts",
    "summarise",
]


@dataclass(frozen=True, repr=False)
class MultimodalParts:
    """A multimodal module split into maximal frozen and trainable submodule paths."""

    found: MultimodalModule
    frozen: list[str]
    trainable: list[str]

    def __repr__(self) -> str:
        return (
            f"MultimodalParts({self.found.path!r}, frozen={self.frozen}, "
            f"trainable={self.trainable})"
        )


def split_frozen_parts(module: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """Maximal fully frozen and maximal fully trainable submodules of ``module`` (a mixed
    module's own parameters stay with the enclosing unit).

    Args:
        module: a discovered tower or projector.
        path: its qualified name.

    Returns:
        ``(frozen paths, trainable paths)``.
    """
    kind = layer_kind(module)
    if kind != "adapted":
        return ([path] if kind == "frozen" else []), ([path] if kind == "trainable" else [])
    frozen: list[str] = []
    trainable: list[str] = []
    for name, child in module.named_children():
        child_frozen, child_trainable = split_frozen_parts(child, join_path(path, name))
        frozen.extend(child_frozen)
        trainable.extend(child_trainable)
    return frozen, trainable


LayerKind = Literal["frozen", "adapted", "trainable", "empty"]


def layer_kind(module: nn.Module) -> LayerKind:
    """Whether a layer's parameters are all frozen, all trainable, or both (adapted).

    Args:
        module: one layer.

    Returns:
        ``"frozen"``, ``"trainable"``, ``"adapted"``, or ``"empty"`` without parameters.
    """
    flags = {p.requires_grad for p in module.parameters()}
    if not flags:
        return "empty"
    if flags == {False}:
        return "frozen"
    return "trainable" if flags == {True} else "adapted"


def classify_layers(part: MultimodalParts) -> list[tuple[str, LayerKind]]:
    """The kind of each layer of ``part`` (its layer-container items, or itself).

    Args:
        part: a discovered module's parts.

    Returns:
        ``(path, kind)`` per layer.
    """
    found = part.found
    items = list(iter_layer_items(found.module, found.path)) or [(found.path, found.module)]
    return [(path, layer_kind(item)) for path, item in items]


def partly_trainable_note(part: MultimodalParts, policy: str) -> str:
    """One short line: how many layers of each kind, and what ``policy`` does with them.

    Args:
        part: a partly trainable module's parts.
        policy: its frozen-tower policy.

    Returns:
        The note.
    """
    counts = Counter(kind for _, kind in classify_layers(part))
    layers = ", ".join(
        f"{counts[kind]} {kind}" for kind in ("frozen", "adapted", "trainable") if counts[kind]
    )
    cut = len(part.found.path) + 1 if part.found.path else 0
    trainable = [path[cut:] or path for path in part.trainable]
    units = "trainable layers are units; " if counts["trainable"] else ""
    return (
        f"partly trainable (layers: {layers}; trainable parts: {summarise(trainable, 2)}); "
        f"{policy!r}: {units}{frozen_policy(policy).partly_trainable_rule}"
    )


def summarise(paths: Iterable[str], limit: int = 3) -> str:
    """A few paths and how many more, so notes and errors stay short.

    Args:
        paths: the paths.
        limit: how many to name.

    Returns:
        E.g. ``'a', 'b', 'c' and 4 more``.
    """
    return names_text(paths, limit)
