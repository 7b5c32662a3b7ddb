"""A call of the model on some ranks only fails on every waiting rank with an error that
names the ranks and their calls, within the collective timeout (issue 24, item 2).
Scenarios: tests/mp/scenarios_arrival.py (their mesh times out after 8 s)."""

from __future__ import annotations

import pytest
from launches import MpResults

pytestmark = pytest.mark.distributed


def test_eval_on_one_rank_while_the_other_trains(mp2: MpResults) -> None:
    evaluating, training = mp2("arrival_eval_then_train")["outcomes"]
    # The evaluating rank sees at once that rank 1 made a training forward instead.
    assert evaluating["type"] == "CollectiveCallError"
    message = evaluating["message"]
    assert "rank 0 made a forward under torch.no_grad() as call #2" in message
    assert "rank 1 made a training forward as call #2" in message
    assert "run it on every rank" in message
    # The training rank, left in an all-gather, fails at the group's timeout, with what
    # the other rank did as a note.
    assert training["type"] != ""
    notes = "\n".join(training["notes"])
    assert "rank 1 made a training forward as call #2" in notes


def test_eval_alone_names_the_rank_that_did_not_arrive(mp2: MpResults) -> None:
    evaluating, idle = mp2("arrival_eval_alone")["outcomes"]
    assert evaluating["type"] == "CollectiveCallError"
    message = evaluating["message"]
    assert "ranks [1] did not make call #2 within 8 s" in message
    assert "rank 1: #1, a training forward" in message
    assert idle["type"] == ""


def test_a_tower_called_by_hand_on_one_rank(mp2: MpResults) -> None:
    calling, training = mp2("arrival_tower_by_hand")["outcomes"]
    assert calling["type"] == "CollectiveCallError"
    assert "a call of 'vision' outside the forward as call #2" in calling["message"]
    assert "rank 1 made a training forward as call #2" in calling["message"]
    assert "rank 1 made a training forward" in "\n".join(training["notes"])


def test_eval_on_every_rank_raises_nothing(mp2: MpResults) -> None:
    result = mp2("arrival_eval_everywhere")
    for outcomes in result["outcomes"]:
        assert [o["type"] for o in outcomes] == [""] * 6
    assert result["calls"] == [6, 6]
    assert result["waits"] == [3, 3]  # only the forwards without gradients wait


def test_generate_with_an_empty_batch_on_one_rank(mp2: MpResults) -> None:
    full, empty = mp2("arrival_generate_empty_batch")["outcomes"]
    for outcome in (full, empty):
        assert outcome["type"] == "CollectiveCallError", outcome
        assert "generate() with an empty batch as call #1" in outcome["message"]
        assert "drop_last=True" in outcome["message"]
