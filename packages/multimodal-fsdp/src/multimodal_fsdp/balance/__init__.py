"""Balanced media: every rank encodes an even share of a step's images and videos.

The pieces a runtime hook puts together: layout adapters that split a tower call into
items (``MediaLayout`` and the built-in ``batch-first`` and ``packed-by-grid``
layouts, found with ``media_layout_for``), the deterministic rule that assigns items to
ranks (``assign_items``), and the differentiable exchange that runs one tower call
balanced (``balanced_call``; ``join_without_call`` for a rank without that call, and
``join_remaining_calls``, the barrier for ranks that made fewer calls),
with its collectives and bytes predicted by ``exchange_traffic``.
"""

from multimodal_fsdp.balance.assign import assign_items
from multimodal_fsdp.balance.exchange import balanced_call, join_remaining_calls, join_without_call
from multimodal_fsdp.balance.layouts import (
    BatchFirstLayout,
    CallSpec,
    FieldSpec,
    MediaCall,
    MediaItem,
    MediaLayout,
    OutputSpec,
    PackedByGridLayout,
)
from multimodal_fsdp.balance.registry import media_layout_for, register_media_layout
from multimodal_fsdp.balance.traffic import ExchangeCollective, exchange_traffic

__all__ = [
    "MediaLayout",
    "MediaItem",
    "MediaCall",
    "CallSpec",
    "FieldSpec",
    "OutputSpec",
    "BatchFirstLayout",
    "PackedByGridLayout",
    "register_media_layout",
    "media_layout_for",
    "assign_items",
    "balanced_call",
    "join_without_call",
    "join_remaining_calls",
    "ExchangeCollective",
    "exchange_traffic",
]
