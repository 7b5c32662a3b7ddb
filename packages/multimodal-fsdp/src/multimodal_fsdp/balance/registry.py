"""Which layout adapter a tower's calls use: registered adapters first, then built-ins,
the first whose plan-time probe says it fits.

A layout that does not fit is an error at plan time, not a silent imbalance or a crash
at the first step: ``choose_media_layout`` probes each layout whose signature test
passes ([`probe_layout`][multimodal_fsdp.balance.probe.probe_layout]). When none fits,
one the probe could not try is taken if it is *trusted* for the tower (a registered
adapter, a family layout, ``batch-first`` on ``pixel_values``); otherwise it raises,
naming the tower, its signature, what each probe found and how to register an adapter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from multimodal_fsdp.balance._arguments import forward_signature
from multimodal_fsdp.balance.family_layouts import (
    PackedByLengthLayout,
    PackedBySizeLayout,
    TiledLayout,
)
from multimodal_fsdp.balance.generic_layouts import BatchFirstLayout, PackedByGridLayout
from multimodal_fsdp.balance.layouts import MediaLayout
from multimodal_fsdp.balance.probe import ProbeReport, probe_layout

__all__ = ["register_media_layout", "media_layout_for", "choose_media_layout", "LayoutChoice"]

logger = logging.getLogger(__name__)

#: Adapters registered by users and model packages, newest first.
_REGISTERED: list[MediaLayout] = []
#: The built-in adapters, narrowest signature test first (batch-first takes any forward).
_BUILTIN: tuple[MediaLayout, ...] = (
    PackedByGridLayout(),
    PackedByLengthLayout(),
    PackedBySizeLayout(),
    TiledLayout(),
    BatchFirstLayout(),
)


@dataclass(frozen=True)
class LayoutChoice:
    """The layout a tower's calls use (bound to the tower) and what its probe found."""

    layout: MediaLayout
    report: ProbeReport

    def describe(self) -> str:
        """The plan's line for it: the probe's summary, or why it ran unprobed.

        Returns:
            The line.
        """
        if self.report.fits:
            return self.report.summary()
        return (
            f"{self.layout.name}, not probed ({self.report.reason}); its calls are "
            "checked at the first step"
        )


def register_media_layout(layout: MediaLayout) -> None:
    """Make ``layout`` available to ``media_layout_for``, before every built-in and
    earlier-registered adapter; registering a layout of the same name replaces it.

    Args:
        layout: the adapter (its ``name`` identifies it).

    Raises:
        TypeError: ``layout`` is not a ``MediaLayout`` instance.
        ValueError: its name is empty.
    """
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


_REMEDY = (
    "Subclass multimodal_fsdp.balance.MediaLayout (applies_to, split_call; build_call, "
    "split_output and probe_calls where the defaults do not fit) and pass an instance "
    "to multimodal_fsdp.balance.register_media_layout before planning."
)


def choose_media_layout(tower: nn.Module) -> LayoutChoice:
    """The layout for calls of ``tower`` and its probe report (see the module docstring).

    Args:
        tower: the tower (or encoder).

    Returns:
        The layout and how it was chosen.

    Raises:
        ValueError: no layout fits, naming the tower, its signature and the remedy.
    """
    known = _known()
    tried: list[ProbeReport] = []
    fallback: LayoutChoice | None = None
    for layout in known:
        if not layout.applies_to(tower):
            continue
        bound = layout.bind(tower)
        report = probe_layout(tower, bound)
        if report.fits:
            return LayoutChoice(bound, report)
        tried.append(report)
        if report.status == "unprobed" and bound.trusted(tower):
            choice = LayoutChoice(bound, report)
            if layout in _REGISTERED:
                return choice  # the user's adapter for this tower: no probe needed
            fallback = fallback or choice
    if fallback is not None:
        logger.info("media layout of %s: %s", type(tower).__name__, fallback.describe())
        return fallback
    signature = forward_signature(tower)
    if not tried:
        raise ValueError(
            f"no media layout applies to tower {type(tower).__name__} with forward"
            f"{signature} (known layouts: {[k.name for k in known]}). {_REMEDY}"
        )
    found = "; ".join(report.summary() for report in tried)
    raise ValueError(
        f"no media layout fits tower {type(tower).__name__} with forward{signature}: the "
        f"plan-time probe found {found}. {_REMEDY}"
    )


def media_layout_for(tower: nn.Module, *, name: str | None = None) -> MediaLayout:
    """The adapter for calls of ``tower``, bound to it: the one called ``name``, else the
    first that fits it (``choose_media_layout``: probed, once per tower and layout).

    Args:
        tower: the tower (or encoder).
        name: a layout's name, to skip the choice.

    Returns:
        The bound layout.

    Raises:
        ValueError: ``name`` is unknown, or no layout fits.
    """
    if name is not None:
        for layout in _known():
            if layout.name == name:
                return layout.bind(tower)
        raise ValueError(
            f"unknown media layout {name!r}; valid choices: {sorted({k.name for k in _known()})}"
        )
    return choose_media_layout(tower).layout
