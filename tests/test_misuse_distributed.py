"""Misuse is caught on every rank with the same clear error (issue 17, items 8 and 9)."""

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


def test_an_optimizer_built_before_parallelize_stops_on_every_rank(mp2: MpResults) -> None:
    result = mp2("misuse_optimizer_before_parallelize")
    message = _same_error_on_every_rank(result["errors"], "StaleOptimizerError")
    assert "built before the model was sharded" in message
    assert "'lm_head.weight'" in message
    assert "build the optimizer after parallelize" in message
    assert result["moved"] == [True, True]


def test_lora_after_parallelize_stops_at_the_first_forward_on_every_rank(
    mp2: MpResults,
) -> None:
    result = mp2("misuse_lora_after_parallelize")
    message = _same_error_on_every_rank(result["errors"], "ModuleTreeChangedError")
    assert "changed since it was sharded" in message
    assert "wrapped by adapters (weights moved under 'base_layer'): 'layers.0.q_proj'" in message
    assert "added: 'layers.0.q_proj.lora_A.default.weight'" in message
    assert "before planning and sharding" in message
    assert result["alive"] == 2.0


def test_a_plan_made_before_lora_is_refused_on_every_rank(mp2: MpResults) -> None:
    result = mp2("misuse_plan_before_lora")
    message = _same_error_on_every_rank(result["errors"], "ModuleTreeChangedError")
    assert "changed since the plan was made" in message
    assert "base_model.model." in message
    assert "nothing was sharded" in message
    assert result["trained"] is True
