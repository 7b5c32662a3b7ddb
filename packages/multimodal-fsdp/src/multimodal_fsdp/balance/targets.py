"""What a balanced tower's calls are: the tower's own, or the encoders it calls.

Some discovered towers are wrappers that also take text (Phi-4-multimodal's image and
audio embeddings call their encoder on the media and merge the features into the text).
No layout can cut such a call by item, but the encoder's call can be:
``balance_targets`` then balances the encoders inside, provided every FSDP unit under
the tower lies inside one of them (one outside would run only on the calling ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from fsdp_core.containers import is_under
from multimodal_fsdp.balance.registry import LayoutChoice, choose_media_layout

__all__ = ["BalanceTarget", "balance_targets", "inner_encoders"]

logger = logging.getLogger(__name__)

#: A module path, its layout choice, and the discovered tower it belongs to.
BalanceTarget = tuple[str, LayoutChoice]


def _has_layer_stack(module: nn.Module) -> bool:
    return any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) for m in module.modules())


def inner_encoders(tower: nn.Module, path: str) -> list[str]:
    """The outermost submodules of ``tower`` (at ``path``) that hold a layer stack (an
    ``nn.ModuleList`` or ``nn.ModuleDict`` of layers): the encoders a wrapper calls.

    Args:
        tower: a discovered tower.
        path: its qualified name.

    Returns:
        The encoders' qualified names.
    """
    found: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            child_path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                continue  # the wrapper's own layers: not an encoder it calls
            if _has_layer_stack(child):
                found.append(child_path)
            else:
                walk(child, child_path)

    walk(tower, path)
    return found


def balance_targets(model: nn.Module, path: str, unit_paths: Sequence[str]) -> list[BalanceTarget]:
    """The modules whose calls balance the discovered tower at ``path``: the tower itself
    when a layout fits it, else the encoders inside it (``inner_encoders``) when a layout
    fits each and every unit under the tower lies inside one.

    Args:
        model: the model.
        path: the discovered tower's qualified name.
        unit_paths: the plan's unit paths.

    Returns:
        The modules to balance, each with its layout.

    Raises:
        ValueError: neither the tower nor its encoders can be balanced (the tower's own
            error, with the encoders tried).
    """
    tower = model.get_submodule(path) if path else model
    try:
        return [(path, choose_media_layout(tower))]
    except ValueError as error:
        own = error
    encoders = inner_encoders(tower, path)
    if not encoders:
        raise own
    choices: list[BalanceTarget] = []
    for encoder in encoders:
        try:
            choices.append((encoder, choose_media_layout(model.get_submodule(encoder))))
        except ValueError as inner:
            raise ValueError(
                f"{own} Its encoder {encoder!r} cannot be balanced either: {inner}"
            ) from None
    outside = [
        unit
        for unit in unit_paths
        if is_under(unit, path) and not any(is_under(unit, e) for e in encoders)
    ]
    if outside:
        raise ValueError(
            f"{own} Its encoders {encoders} could be balanced, but the units {outside} lie "
            "outside them and would run only on the ranks that call the tower"
        )
    logger.info("balance_media: tower %r is balanced through its encoders %s", path, encoders)
    return choices
