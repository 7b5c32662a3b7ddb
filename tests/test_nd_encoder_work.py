"""Encoder work per rank on a ``('dp', 'tp')`` 2x2 mesh (4 gloo ranks), measured.

The scenario ``nd_encoder_work`` (``tests/mp/scenarios_nd.py``) counts the images each
rank's frozen tower encodes in one training step of the tiny DeepSeek-V4.1 reference
model, its language MLPs tensor-parallel over ``tp``, the library over ``dp`` (root
policy), for even media, uneven media and all media on one data group.

Ranks ``2 * d + t``: data group ``d`` (ranks 0, 1 and ranks 2, 3) holds DP coordinate
``d``'s batch. Today ``balance_media`` balances each TP rank with its data-parallel
peers only (ranks 0, 2 and ranks 1, 3), so every image is encoded once per TP rank.
Issue 34 item 3 (encode each image once in the world) is pinned by the strict xfail:
it starts passing, and so fails, when that lands.
"""

from __future__ import annotations

import pytest
from launches import MpResults
from scenarios_nd import ENCODER_MEDIA

pytestmark = pytest.mark.distributed

TP = 2
#: Samples per batch (``vlm_batches``): a DP coordinate holds 2 * images per sample.
SAMPLES = 2


def _images(name: str) -> list[int]:
    return [SAMPLES * n for n in ENCODER_MEDIA[name]]


@pytest.mark.parametrize("name", sorted(ENCODER_MEDIA))
def test_without_balancing_each_rank_encodes_its_data_groups_images(
    name: str, mp4: MpResults
) -> None:
    rows = mp4("nd_encoder_work")[f"{name}/plain"]
    images = _images(name)
    assert rows == [images[rank // TP] for rank in range(4)]


@pytest.mark.parametrize("name", sorted(ENCODER_MEDIA))
def test_balancing_splits_each_tp_ranks_images_over_its_dp_peers(name: str, mp4: MpResults) -> None:
    """Each TP rank (column of the mesh) encodes every image once, spread over its DP
    peers to within one image (the images cost the same); the TP peers do the same
    work."""
    rows = mp4("nd_encoder_work")[f"{name}/balanced"]
    total = sum(_images(name))
    for tp in range(TP):
        column = rows[tp::TP]
        assert sum(column) == total, rows
        assert max(column) - min(column) <= 1, rows
    assert rows[0::TP] == rows[1::TP], rows


@pytest.mark.xfail(
    strict=True,
    reason="issue 34 item 3: balance_media encodes each image once per TP rank, not once "
    "in the world",
)
@pytest.mark.parametrize("name", sorted(ENCODER_MEDIA))
def test_balancing_encodes_each_image_once_in_the_world(name: str, mp4: MpResults) -> None:
    rows = mp4("nd_encoder_work")[f"{name}/balanced"]
    assert sum(rows) == sum(_images(name)), rows
    assert max(rows) - min(rows) <= 1, rows
