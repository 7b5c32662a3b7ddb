"""Encoder work per rank on a ``('dp', 'tp')`` 2x2 mesh (4 gloo ranks), measured.

The scenario ``nd_encoder_work`` (``tests/mp/scenarios_nd.py``) trains the tiny
DeepSeek-V4.1 reference model, its language MLPs tensor-parallel over ``tp`` and the
library over ``dp``, for even media, uneven media and all media on one data group (the
other text-only): ``balance_media`` under each frozen-tower policy, without it under
``root``, and a trainable tower. It counts the images each rank's tower encodes in the
first step and compares losses, gradients and parameters with one process.

Ranks ``2 * d + t``: data group ``d`` (ranks 0, 1 and ranks 2, 3) holds DP coordinate
``d``'s batch. Without balancing each rank encodes its whole batch's images, so every
image twice (once per TP rank); with ``balance_media`` each image is encoded once in the
world (before issue 34 item 3, each TP rank balanced with its data-parallel peers only:
[1, 1, 1, 1] images for even media was [2, 2, 2, 2]), for a trainable tower too.
"""

from __future__ import annotations

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from scenarios_nd import (
    ENCODER_MEDIA,
    POLICIES,
    SINGLE,
    TP_TOWER_CASES,
    encoder_batches,
    encoder_cases,
)
from toy import reference_run
from vlm import LR, build_vlm, vlm_loss

pytestmark = pytest.mark.distributed

TP = 2
#: Samples per batch (``vlm_batches``): a DP coordinate holds 2 * images per sample.
SAMPLES = 2


def _images(name: str) -> list[int]:
    return [SAMPLES * n for n in ENCODER_MEDIA[name]]


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, bool], tuple]:  # type: ignore[type-arg]
    """One process on both DP batches of each step, per distribution and tower kind."""
    return {
        (name, trainable): reference_run(
            lambda trainable=trainable: build_vlm(  # type: ignore[misc]
                dtype=torch.float32, frozen_tower=not trainable
            ),
            encoder_batches(name),
            vlm_loss,
            compute_dtype=None,
            lr=LR,
        )
        for name in [*ENCODER_MEDIA, SINGLE]
        for trainable in (False, True)
        if trainable or name != SINGLE
    }


@pytest.mark.parametrize("name", sorted(ENCODER_MEDIA))
def test_without_balancing_each_rank_encodes_its_data_groups_images(
    name: str, mp4: MpResults
) -> None:
    rows = mp4("nd_encoder_work")[f"{name}/root/plain"]["rows"]
    images = _images(name)
    assert rows == [images[rank // TP] for rank in range(4)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(ENCODER_MEDIA))
def test_balancing_encodes_each_image_once_in_the_world(
    name: str, policy: str, mp4: MpResults
) -> None:
    """The ranks of a TP group share their batch's images and the four ranks balance
    them: each image is encoded once, every rank within one image of the others."""
    rows = mp4("nd_encoder_work")[f"{name}/{policy}/balanced"]["rows"]
    assert sum(rows) == sum(_images(name)), rows
    assert max(rows) - min(rows) <= 1, rows


@pytest.mark.parametrize("name", sorted(ENCODER_MEDIA))
def test_a_trainable_tower_encodes_each_image_once_in_the_world(name: str, mp4: MpResults) -> None:
    """The ranks of a TP group split a trainable tower's images too (before, each TP rank
    encoded every image: [3, 3, 3, 3] for the 6 images of ``uneven``), and the
    ``replica_grad_reduce`` hook sums the tower's gradients over the TP group
    (``test_trains_like_one_process`` compares them with one process)."""
    result = mp4("nd_encoder_work")[f"{name}/per_layer/trainable"]
    rows = result["rows"]
    assert sum(rows) == sum(_images(name)), rows
    assert max(rows) - min(rows) <= 1, rows
    assert "replica_grad_reduce" in result["hooks"]


def test_a_call_of_fewer_images_than_tp_ranks_is_encoded_by_each_and_counted_once(
    mp4: MpResults,
) -> None:
    """One image per data group: not split, both TP ranks encode it; only the first
    one's output carries gradients back, so the summed tower gradients count it once
    (``test_trains_like_one_process[single/per_layer/trainable]``)."""
    assert mp4("nd_encoder_work")[f"{SINGLE}/per_layer/trainable"]["rows"] == [1, 1, 1, 1]


@pytest.mark.parametrize("case", encoder_cases())
def test_trains_like_one_process(
    case: str,
    mp4: MpResults,
    references: dict[tuple[str, bool], tuple],  # type: ignore[type-arg]
) -> None:
    name, _, variant = case.split("/")
    result = mp4("nd_encoder_work")[case]
    check_against_reference(result, references[(name, variant == "trainable")], TOL[torch.float32])


def test_inputs_that_require_a_gradient_stop_every_rank(mp4: MpResults) -> None:
    """A rank encodes only its share of its TP group's images, so it cannot give the
    inputs their whole gradient: all four ranks raise the same ValueError, and the job
    can still run a collective afterwards (no rank is left waiting)."""
    result = mp4("nd_balanced_input_grads")
    kinds = {kind for kind, _ in result["errors"]}
    messages = {message for _, message in result["errors"]}
    assert kinds == {"ValueError"}, result["errors"]
    assert len(messages) == 1, messages
    assert "require a gradient" in messages.pop()
    assert result["alive"] == 4.0


@pytest.mark.parametrize("case", TP_TOWER_CASES)
def test_a_tensor_parallel_tower_runs_the_same_images_on_each_tp_rank(
    case: str,
    mp4: MpResults,
    references: dict[tuple[str, bool], tuple],  # type: ignore[type-arg]
) -> None:
    """The vision tower's MLPs tensor-parallel over ``tp`` (``nd_tp_tower``): its TP
    collectives pair the ranks of a TP group, so both run the same images (balanced over
    the data-parallel ranks only, each image once per TP group rank, half the images per
    data-parallel rank); its gradients are not summed over TP (no ``replica_grad_reduce``);
    and the job trains like one process."""
    name, _, variant = case.split("/")
    result = mp4("nd_tp_tower")[case]
    rows = result["rows"]
    assert [rows[rank] for rank in range(0, 4, TP)] == [rows[rank + 1] for rank in range(0, 4, TP)]
    assert sum(rows) == TP * sum(_images(name)), rows
    assert max(rows) - min(rows) <= 1, rows
    assert "replica_grad_reduce" not in result["hooks"]
    check_against_reference(
        result, references[(name, variant.endswith("trainable"))], TOL[torch.float32]
    )
