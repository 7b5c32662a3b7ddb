"""balance_media=True with media-dependent modules that own FSDP units, on 2 gloo ranks
against one process (``mp/balanced_joined.py``): Mllama's cross-attention decoder layers
and Idefics2's connector (a trainable perceiver resampler with layers), under ``root``,
``per_layer`` and with a trainable tower, through a step with a text-only rank, an even
step, a step without media anywhere and a step with all media on the other rank (AdamW,
an eval pass before each step for the ``root`` cases).

Before ranks joined these modules, every such case stopped at its first step on every
rank with ``UnevenMediaError`` ("... run only with media and own FSDP units: decoder
layer 'model.language_model.layers.1'" for Mllama, "projector 'model.connector'" for
Idefics2): a rank with a text-only batch skipped their collectives.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

import balanced_joined
from compare import TOL, check_against_reference
from launches import MpResults
from reference import ReferenceRun, reference_training

pytestmark = pytest.mark.distributed

MATCHING = sorted(n for n, c in balanced_joined.CASES.items() if c.expect == "match")


@functools.cache
def _reference(name: str) -> ReferenceRun:
    case = balanced_joined.CASES[name]
    return reference_training(
        case.reference_model,
        case.step_fn(),
        steps=case.steps,
        world=case.world,
        compute_dtype=case.compute_dtype,
        optimizer=case.optimizer_fn(),
    )


@pytest.mark.parametrize("name", MATCHING)
def test_joined_modules_train_like_one_process(name: str, mp2: MpResults) -> None:
    """Losses, first-step gradients, final parameters, and which parameters got no
    gradient in each step (the step without media: the cross-attention layers' and the
    connector's keep none, as in one process, so AdamW leaves them alone)."""
    result = mp2(f"balance_joined_{name}")
    if "skipped" in result:
        pytest.skip(result["skipped"])
    case = balanced_joined.CASES[name]
    errors = [message for message, _ in result["errors"]]
    assert errors == [""] * case.world, errors[0]
    assert "balance_media" in result["hooks"]
    assert "schedule_check" not in result["hooks"]
    ref = _reference(name)
    check_against_reference(result, ref.as_tuple(), TOL[torch.float32])
    assert [frozenset(step) for step in result["unused"]] == ref.unused
    joined = "language_model.layers.1." if name.startswith("mllama") else "connector."
    no_media = ref.unused[2]
    assert any(joined in param for param in no_media), sorted(no_media)
    # The joined modules keep units of their own (no root join).
    assert any(joined.rstrip(".") in label for label in result["units"]), result["units"]


def test_without_balancing_the_connector_stops_every_rank(mp2: MpResults) -> None:
    """Without balancing, Idefics2's connector is a media region: the step with a text-only
    rank stops on every rank with the same UnevenMediaError, which names balance_media=True
    as the first remedy."""
    result = mp2("balance_joined_idefics2_root_unbalanced")
    if "skipped" in result:
        pytest.skip(result["skipped"])
    messages = [message for message, _ in result["errors"]]
    assert len(set(messages)) == 1, messages
    assert messages[0]
    assert "projector 'model.connector'" in messages[0]
    assert messages[0].split("To fix it, ")[1].startswith("pass balance_media=True")
    assert [done for _, done in result["errors"]] == [0, 0]
