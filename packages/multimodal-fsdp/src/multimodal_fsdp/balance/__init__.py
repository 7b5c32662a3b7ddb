"""Balanced media: every rank encodes an even share of a step's images and videos.

The pieces a runtime hook puts together: layout adapters that split a tower call into
items (``MediaLayout``; the built-in ``batch-first``, ``packed-by-grid``,
``packed-by-size``, ``packed-by-length`` and ``tiled`` layouts), chosen per tower when
the plan is made by a probe that runs the tower on tiny calls (``choose_media_layout``,
``probe_layout``; ``media_layout_for`` returns the layout), the deterministic rule that
assigns items to ranks (``assign_items``), and the differentiable exchange that runs one
tower call balanced (``balanced_call``; ``join_without_call`` for a rank without that call, and
``join_remaining_calls``, the barrier for ranks that made fewer calls),
with its collectives and bytes predicted by ``exchange_traffic``.
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
