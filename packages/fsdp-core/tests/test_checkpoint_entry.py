"""save_checkpoint, load_checkpoint(_unsharded), export_full_state_dict and the
materialisers are collective: a call on some ranks only is named, a failure on one
rank is raised on all, and a save that fails midway keeps the previous checkpoint
(2 spawned gloo ranks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fsdp_core.testing import run_on_gloo_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _checkpoint_entry_rank_fns as rank_fns


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("checkpoint_entry")
    run_on_gloo_ranks(rank_fns.checkpoint_cases, 2, str(out), timeout_s=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_together_save_and_load(cases: list[dict[str, Any]]) -> None:
    for rank in cases:
        assert rank["save"]["type"] is None, rank["save"]
        assert rank["load"]["type"] is None, rank["load"]
        assert rank["after_alone"]["type"] is None
        assert rank["unsharded"]["type"] is None, rank["unsharded"]
        assert rank["materialize"]["type"] is None, rank["materialize"]


@pytest.mark.parametrize("case", ["save_alone", "load_alone", "export_alone", "full_alone"])
def test_a_call_on_rank_zero_only_names_the_missing_rank(
    cases: list[dict[str, Any]], case: str
) -> None:
    outcome = cases[0][case]
    assert outcome["type"] == "CollectiveCallError"
    assert "ranks [1] did not arrive" in outcome["message"]


@pytest.mark.parametrize(
    ("case", "failing"), [("load_missing", 1), ("save_not_dir", 1), ("full_none", 0)]
)
def test_a_precondition_failing_on_one_rank_fails_on_every_rank(
    cases: list[dict[str, Any]], case: str, failing: int
) -> None:
    first, second = cases[0][case], cases[1][case]
    assert first["type"] is not None
    assert first == second
    assert f"failed on rank {failing}" in first["message"]


def test_a_save_failing_midway_keeps_the_previous_checkpoint(cases: list[dict[str, Any]]) -> None:
    assert cases[0]["save_fails"] == cases[1]["save_fails"]
    assert "No space left" in cases[0]["save_fails"]["message"]
    for rank in cases:
        assert rank["old_step"] == 3
        assert rank["old_kept"] is True
        assert rank["left_over"] == []
