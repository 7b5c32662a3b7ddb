"""Phi-4-multimodal on 2 gloo ranks under ``per_layer`` (issue 24, item 2): its encoders sit
inside a module that every rank calls (``model.embed_tokens_extend``), and only ranks with
images run the image encoder's units.

With images on rank 0 only, both ranks must stop with the same ``UnevenMediaError`` in
the first step (before: the ranks' all-gathers parted inside the feature embedding and
the step hung until gloo's timeout). With images on every rank, training must equal one
process on the global batch.
"""

from __future__ import annotations

import functools

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from phi4 import CASES
from reference import ReferenceRun, reference_training

pytestmark = [pytest.mark.distributed, pytest.mark.transformers]

pytest.importorskip("transformers")


@functools.cache
def reference(name: str) -> ReferenceRun:
    case = CASES[name]
    return reference_training(
        case.build_model,
        case.step_fn(),
        steps=case.steps,
        world=case.world,
        compute_dtype=case.compute_dtype,
        optimizer=case.optimizer_fn(),
    )


def _result(name: str, mp2: MpResults) -> dict[str, object]:
    result = mp2(name)
    if "skipped" in result:
        pytest.skip(str(result["skipped"]))
    return result


def test_images_on_one_rank_stop_every_rank_with_the_same_error(mp2: MpResults) -> None:
    result = _result("phi4_per_layer_images_on_rank0", mp2)
    errors = result["errors"]
    assert isinstance(errors, list)
    messages = [message for message, _ in errors]
    assert [done for _, done in errors] == [0, 0]  # in the first step
    assert all(messages), messages  # every rank raised UnevenMediaError
    assert messages[0] == messages[1]
    message = messages[0]
    assert "about to run 'model.embed_tokens_extend.image_embed." in message, message
    assert "frozen_multimodal_sharding='root' or 'replicate'" in message
    assert "schedule_check" in result["hooks"]  # type: ignore[operator]


def test_images_on_every_rank_train_like_one_process(mp2: MpResults) -> None:
    name = "phi4_per_layer_images_on_every_rank"
    result = _result(name, mp2)
    errors = result["errors"]
    assert isinstance(errors, list)
    assert [message for message, _ in errors] == ["", ""], errors
    ref = reference(name)
    check_against_reference(result, ref.as_tuple(), TOL[torch.float32])
    assert [frozenset(step) for step in result["unused"]] == ref.unused  # type: ignore[attr-defined]
    # The image encoder's layers are units of their own (per_layer).
    units = result["units"]
    assert isinstance(units, list)
    assert any(u.startswith("model.embed_tokens_extend.image_embed.") for u in units), units
