"""Encoder work per rank on a ``('dp', 'tp')`` 2x2 mesh (4 gloo ranks), measured.

The scenario ``nd_encoder_work`` (``tests/mp/scenarios_nd.py``) counts the images each
rank's frozen tower encodes in one training step of the tiny DeepSeek-V4.1 reference
model, its language MLPs tensor-parallel over ``tp``, the library over ``dp`` (root
policy), for even media, uneven media and all media on one data group.

Ranks ``2 * d + t``: data group ``d`` (ranks 0, 1 and ranks 2, 3) holds DP coordinate
``d``'s batch. Without balancing each rank encodes its whole batch's images, so every
image twice (once per TP rank); with ``balance_media`` each image is encoded once in the
world (before issue 34 item 3, each TP rank balanced with its data-parallel peers only:
[1, 1, 1, 1] images for even media was [2, 2, 2, 2]).
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
def test_balancing_encodes_each_image_once_in_the_world(name: str, mp4: MpResults) -> None:
    """The ranks of a TP group share their batch's images and the four ranks balance
    them: each image is encoded once, every rank within one image of the others."""
    rows = mp4("nd_encoder_work")[f"{name}/balanced"]
    assert sum(rows) == sum(_images(name)), rows
    assert max(rows) - min(rows) <= 1, rows
