"""The backward-reachability rule: which frozen modules no gradient ever reaches.

Frozen parts of towers and projectors that come before every trainable parameter of
their modality see only media inputs, so FSDP2 never runs (or re-gathers for) their
backward; the costs count backward all-gathers and the prefetch guard's savings by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fsdp_core.containers import module_spans
from multimodal_fsdp.discovery.walk import resolve_multimodal_modules
from multimodal_fsdp.parts import MultimodalParts, split_frozen_parts

__all__ = ["backward_free_paths"]


def _parts_in_flow_order(parts: Sequence[MultimodalParts]) -> dict[str, list[MultimodalParts]]:
    """Multimodal modules per modality, towers before projectors (the data flow)."""
    groups: dict[str, list[MultimodalParts]] = {}
    for part in parts:
        groups.setdefault(part.found.modality, []).append(part)
    for members in groups.values():
        members.sort(key=lambda p: 0 if p.found.role == "tower" else 1)
    return groups


def backward_free_paths(
    model: nn.Module,
    *,
    parts: Sequence[MultimodalParts] | None = None,
) -> list[str]:
    """Frozen module paths that no gradient reaches in a step: per modality, the frozen
    parts of its towers then projectors met before the first trainable parameter.

    Args:
        model: the model.
        parts: the discovered towers' and projectors' parts (default: discovery with
            default options).

    Returns:
        The qualified names of those frozen modules.
    """
    if parts is not None:
        found = list(parts)
    else:
        found = [
            MultimodalParts(item, *split_frozen_parts(item.module, item.path))
            for item in resolve_multimodal_modules(model)
        ]
    spans = module_spans(model)
    free: list[str] = []
    for members in _parts_in_flow_order(found).values():
        for part in members:
            events: list[tuple[int, str, str]] = [
                (spans[p][0], "frozen", p) for p in part.frozen if p in spans
            ]
            events += [(spans[p][0], "trainable", p) for p in part.trainable if p in spans]
            # Trainable parameters held directly by a mixed module stop the walk there.
            for name, sub in part.found.module.named_modules(prefix=part.found.path):
                if any(p.requires_grad for p in sub.parameters(recurse=False)) and name in spans:
                    events.append((spans[name][0], "trainable", name))
            ordered = sorted(events)
            cut = next((i for i, (_, kind, _) in enumerate(ordered) if kind == "trainable"), None)
            free.extend(path for _, _, path in ordered[:cut])
            if cut is not None:  # a trainable parameter: the rest of this modality sees it
                break
    return free
