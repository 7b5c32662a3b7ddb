"""Checkpoints never lose data, and collective calls fail on every rank (2 gloo ranks).

Reads the results of ``mp/scenarios_checkpoint_safety.py``: a write failure on
rank 0 is raised on both ranks and leaves the old export loadable; loading from a
directory and saving straight back into it is no race; an unwritable destination
fails on both ranks before any gather; ``if rank == 0: save_pretrained(...)``
(and load) raises on rank 0 naming rank 1 instead of hanging, and the group
stays usable; ranks applying different plans all raise.
"""

from __future__ import annotations

from typing import Any

import pytest
from launches import MpResults

pytestmark = [pytest.mark.distributed, pytest.mark.transformers]


def _result(mp2: MpResults, name: str) -> dict[str, Any]:
    result = mp2(f"ckpt_safety_{name}")
    if "skipped" in result:
        pytest.fail(f"the ranks lacked a dependency: {result['skipped']}")
    return result


def test_write_failure_keeps_the_old_export_and_fails_on_every_rank(mp2: MpResults) -> None:
    result = _result(mp2, "write_failure")
    outcomes = result["outcomes"]
    assert [o["type"] for o in outcomes] == ["OSError", "OSError"]
    assert [o["errno"] for o in outcomes] == [28, 28]
    assert outcomes[0]["message"] == outcomes[1]["message"]
    assert "failed on rank 0 (writing model-00002-of-00005.safetensors)" in outcomes[0]["message"]
    assert result["files_after"] == result["files_before"]
    assert "README.md" in result["files_after"]
    assert result["siblings"] == []
    assert result["old_loads"] is True


def test_load_then_save_into_the_same_directory(mp2: MpResults) -> None:
    result = _result(mp2, "load_then_save")
    assert [o["type"] for o in result["outcomes"]] == [None, None], result["outcomes"]
    assert result["loads_bf16"] is True
    assert result["siblings"] == []
    stale = set(result["files_before"]) - set(result["files_after"])
    assert all(name.startswith("model-") for name in stale)


def test_unwritable_destination_fails_on_every_rank_before_any_gather(mp2: MpResults) -> None:
    result = _result(mp2, "unwritable")
    outcomes = result["outcomes"]
    assert [o["type"] for o in outcomes] == ["PermissionError", "PermissionError"]
    assert outcomes[0]["message"] == outcomes[1]["message"]
    assert "failed on rank 0" in outcomes[0]["message"]
    assert result["collectives"] == [0, 0]


def test_rank0_only_calls_raise_naming_the_missing_rank(mp2: MpResults) -> None:
    result = _result(mp2, "rank0_only")
    for call in ("save", "load"):
        outcome = result[call]
        assert outcome["type"] == "CollectiveCallError"
        assert f"{call}_pretrained is collective" in outcome["message"]
        assert "ranks [1] did not arrive" in outcome["message"]
    mixed = result["mixed"]
    assert [o["type"] for o in mixed] == ["CollectiveCallError"] * 2
    assert "rank 1 entered load_pretrained" in mixed[0]["message"]
    assert "rank 0 entered save_pretrained" in mixed[1]["message"]
    assert [o["type"] for o in result["final_load"]] == [None, None]
    assert result["all_reduce"] == 2.0


def test_different_plans_fail_on_every_rank(mp2: MpResults) -> None:
    outcomes = _result(mp2, "plan_mismatch")["outcomes"]
    assert [o["type"] for o in outcomes] == ["PlanMismatchError"] * 2
    assert "rank 1's sharding plan differs from rank 0's" in outcomes[0]["message"]
    assert outcomes[0]["message"] == outcomes[1]["message"]
