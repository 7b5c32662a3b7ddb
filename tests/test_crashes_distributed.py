"""Deep crashes and a silent no-op become the same clear error on every rank (issue 24,
item 4); scenarios in tests/mp/scenarios_crashes.py."""

from __future__ import annotations

import pytest
from launches import MpResults

pytestmark = pytest.mark.distributed


def _same_error_on_every_rank(errors: list[tuple[str, str]], kind: str) -> str:
    kinds = {name for name, _ in errors}
    messages = {message for _, message in errors}
    assert kinds == {kind}, errors
    assert len(messages) == 1, messages  # the same words on every rank
    return messages.pop()


def _skip_if_skipped(result: dict[str, object]) -> None:
    if "skipped" in result:
        pytest.skip(str(result["skipped"]))


def test_uneven_micro_batch_counts_stop_every_rank_before_the_backward(mp2: MpResults) -> None:
    # Before: gloo EnforceNotMet ("Received data size doesn't match expected size"), SIGABRT.
    result = mp2("crash_uneven_micro_batches")
    message = _same_error_on_every_rank(result["errors"], "StepMismatchError")
    assert "not in the same gradient-accumulation step" in message
    assert "rank 0 at micro-batch 1 of its step, gradient sync off" in message
    assert "rank 1 at micro-batch 1 of its step, gradient sync on (its last" in message
    assert "same number of micro-batches per optimizer step" in message
    assert "dist.ReduceOp.MIN" in message
    assert result["alive"] == 2.0


def test_gradient_sync_changed_after_the_forward_stops_every_rank(mp2: MpResults) -> None:
    result = mp2("crash_sync_set_after_forward")
    message = _same_error_on_every_rank(result["errors"], "StepMismatchError")
    assert "rank 0 changed set_requires_gradient_sync between a forward" in message
    assert "before each micro-batch's forward" in message
    assert result["alive"] == 2.0


def test_an_empty_batch_on_one_rank_stops_every_rank(mp2: MpResults) -> None:
    # Before: "cannot reshape tensor of 0 elements" inside transformers on rank 0,
    # "Connection closed by peer" on rank 1.
    result = mp2("crash_empty_batch")
    _skip_if_skipped(result)
    messages = {
        _same_error_on_every_rank(result[f"{name}_{mode}"], "EmptyBatchError")
        for name in ("plain", "balance_media")
        for mode in ("train", "eval")
    }
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "rank 0 called the model with an empty batch" in message
    assert "drop_last=True" in message
    assert result["alive"] == 2.0  # and the model trained on after


def test_a_meta_model_never_loaded_stops_at_its_first_forward(mp2: MpResults) -> None:
    # Before: IndexError: index out of range in self (CLIP's garbage position_ids).
    result = mp2("crash_never_loaded")
    _skip_if_skipped(result)
    message = _same_error_on_every_rank(result["errors"], "UninitializedWeightsError")
    assert "sharded on the meta device and none of its 64 parameters" in message
    assert "to_empty() allocates memory without values" in message
    assert "load_pretrained(model, directory)" in message
    assert "mark_weights_loaded(model)" in message
    assert result["alive"] == 2.0


def test_load_checkpoint_after_to_empty_recomputes_the_buffers(mp2: MpResults) -> None:
    # Before: 'Missing key in checkpoint state_dict: step.' (saved without step=), and
    # with a step IndexError at the forward (non-persistent buffers left undefined).
    result = mp2("crash_checkpoint_after_to_empty")
    _skip_if_skipped(result)
    assert result["errors"] == [("", ""), ("", "")]
    assert result["step"] is None
    assert result["loss"] == result["expected"]
    # The same for a full state dict broadcast from rank 0 (load_full_state_dict).
    assert result["broadcast_errors"] == [("", ""), ("", "")]
    assert result["broadcast_loss"] == result["expected"]


def test_an_optimizer_step_with_gradient_sync_off_stops_every_rank(mp2: MpResults) -> None:
    # Before: the step silently changed nothing.
    result = mp2("crash_sync_never_on")
    message = _same_error_on_every_rank(result["off"], "UnreducedGradientsError")
    assert "AdamW.step() follows backwards with gradient sync off" in message
    assert "gradient sync is still off" in message
    assert "set_requires_gradient_sync(is_last_micro_batch)" in message
    late = _same_error_on_every_rank(result["turned_on_late"], "UnreducedGradientsError")
    assert "on again, but it was off during the last backward" in late
    assert result["unchanged"] is True
    assert result["moved"] is True
