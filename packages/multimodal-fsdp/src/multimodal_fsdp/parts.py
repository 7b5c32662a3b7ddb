"""How a multimodal module splits into the pieces the frozen-tower policy acts on.

A tower or projector is fully frozen, fully trainable, or partly trainable (a
trainable merger inside a frozen tower, LoRA adapters in frozen blocks). The
parallelizer plans each piece differently, so the split is its own concept:

- [`split_frozen_parts`][multimodal_fsdp.parts.split_frozen_parts]: the maximal fully frozen and
  fully trainable submodules;
- [`classify_layers`][multimodal_fsdp.parts.classify_layers]: each layer-container item of a partly
  trainable module as *frozen*, *trainable* or *adapted* (frozen weights with trainable ones
  inside);
- [`partly_trainable_note`][multimodal_fsdp.parts.partly_trainable_note]: the one-line plan note
  that summarises them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torch import nn

from fsdp_core.containers import iter_layer_items, join_path
from multimodal_fsdp.discovery.names import MultimodalModule
from multimodal_fsdp.policy import frozen_policy, module_is_fully_frozen

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


def _has_frozen_param(module: nn.Module) -> bool:
    return any(not p.requires_grad for p in module.parameters())


def split_frozen_parts(module: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """Maximal fully frozen and maximal fully trainable submodules of ``module``.

    Parameters held directly by a mixed module stay with the enclosing unit.

    Args:
        module: a discovered tower or projector.
        path: its qualified name.

    Returns:
        ``(frozen paths, trainable paths)``.
    """
    if module_is_fully_frozen(module):
        return [path], []
    if not _has_frozen_param(module):
        return [], ([path] if any(True for _ in module.parameters()) else [])
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
    """The layers of ``part`` (its layer-container items, or itself without any), each
    fully frozen, fully trainable, or *adapted* (frozen weights with trainable ones).

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
        E.g. ``"a, b, c and 4 more"``.
    """
    items = list(paths)
    head = ", ".join(repr(p) for p in items[:limit])
    return head + (f" and {len(items) - limit} more" if len(items) > limit else "")
