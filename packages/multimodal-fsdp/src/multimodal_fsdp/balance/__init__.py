"""Balanced media: every rank encodes an even share of a step's images and videos.

Layout adapters split a tower call into items (``MediaLayout``, built-in or registered),
chosen per tower at plan time by a probe on tiny calls (``choose_media_layout``,
``probe_layout``, ``media_layout_for``); ``assign_items`` gives each rank its items;
``balanced_call`` runs one call balanced (``join_without_call`` and
``join_remaining_calls`` for ranks without it), with the collectives and bytes that
``exchange_traffic`` predicts.
"""

from multimodal_fsdp.balance.assign import assign_items
from multimodal_fsdp.balance.exchange import balanced_call, join_remaining_calls, join_without_call
from multimodal_fsdp.balance.family_layouts import (
    PackedByLengthLayout,
    PackedBySizeLayout,
    TiledLayout,
)
from multimodal_fsdp.balance.generic_layouts import BatchFirstLayout, PackedByGridLayout
from multimodal_fsdp.balance.layouts import (
    CallSpec,
    FieldSpec,
    MediaCall,
    MediaItem,
    MediaLayout,
    OutputSpec,
    ProbeCall,
    RowRule,
)
from multimodal_fsdp.balance.probe import ProbeReport, probe_layout
from multimodal_fsdp.balance.registry import (
    LayoutChoice,
    choose_media_layout,
    media_layout_for,
    register_media_layout,
)
from multimodal_fsdp.balance.traffic import ExchangeCollective, exchange_traffic

__all__ = [
    "MediaLayout",
    "MediaItem",
    "MediaCall",
    "CallSpec",
    "FieldSpec",
    "OutputSpec",
    "RowRule",
    "ProbeCall",
    "BatchFirstLayout",
    "PackedByGridLayout",
    "PackedBySizeLayout",
    "PackedByLengthLayout",
    "TiledLayout",
    "register_media_layout",
    "media_layout_for",
    "choose_media_layout",
    "LayoutChoice",
    "probe_layout",
    "ProbeReport",
    "assign_items",
    "balanced_call",
    "join_without_call",
    "join_remaining_calls",
    "ExchangeCollective",
    "exchange_traffic",
]
