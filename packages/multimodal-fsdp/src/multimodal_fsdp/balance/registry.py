"""Which layout adapter a tower's calls use: registered adapters first, then built-ins.

A tower no adapter understands is an error when balancing is planned, not a silent
imbalance at the first step, so ``media_layout_for`` raises naming the tower's class
and forward signature and how to register an adapter.
"""

from __future__ import annotations

import logging

from torch import nn

from multimodal_fsdp.balance.layouts import (
    BatchFirstLayout,
    MediaLayout,
    PackedByGridLayout,
    forward_signature,
)

__all__ = ["register_media_layout", "media_layout_for"]

logger = logging.getLogger(__name__)

#: Adapters registered by users and model packages, newest first.
_REGISTERED: list[MediaLayout] = []
#: The built-in adapters, asked after the registered ones (packed first: its signature
#: test is the narrower one).
_BUILTIN: tuple[MediaLayout, ...] = (PackedByGridLayout(), BatchFirstLayout())


def register_media_layout(layout: MediaLayout) -> None:
    """Make ``layout`` available to ``media_layout_for``, before every built-in and
    earlier-registered adapter; registering a layout of the same name replaces it."""
    if not isinstance(layout, MediaLayout):
        raise TypeError(
            f"register_media_layout takes a MediaLayout instance, got {type(layout).__name__}"
        )
    if not layout.name:
        raise ValueError(f"{type(layout).__name__}.name must be a non-empty string")
    _REGISTERED[:] = [known for known in _REGISTERED if known.name != layout.name]
    _REGISTERED.insert(0, layout)
    logger.debug("registered media layout %r", layout.name)


def _known() -> list[MediaLayout]:
    return [*_REGISTERED, *_BUILTIN]


def media_layout_for(tower: nn.Module, *, name: str | None = None) -> MediaLayout:
    """The adapter for calls of ``tower``: the one called ``name``, else the first that
    applies to its forward signature."""
    known = _known()
    if name is not None:
        for layout in known:
            if layout.name == name:
                return layout
        raise ValueError(
            f"unknown media layout {name!r}; valid choices: {sorted({k.name for k in known})}"
        )
    for layout in known:
        if layout.applies_to(tower):
            return layout
    raise ValueError(
        f"no media layout applies to tower {type(tower).__name__} with forward"
        f"{forward_signature(tower)} (known layouts: {[k.name for k in known]}). Subclass "
        "multimodal_fsdp.balance.MediaLayout (applies_to, split_call) and pass an instance "
        "to multimodal_fsdp.balance.register_media_layout before planning."
    )
