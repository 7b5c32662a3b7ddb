"""``latest_checkpoint`` finds the checkpoint a restarted job resumes from: the newest
complete one, never an unfinished save (``.<name>.saving-checkpoint``), and the same
on every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fsdp_core.rank_agreement import CollectiveCallError
from fsdp_core.testing import run_on_gloo_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _latest_checkpoint_rank_fns as rank_fns


def _save(path: Path, step: int) -> nn.Module:
    torch.manual_seed(step)
    model = nn.Linear(3, 2)
    save_checkpoint(path, model, step=step)
    return model


def test_no_root_or_an_empty_one_is_no_checkpoint(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "not-yet") is None
    assert latest_checkpoint(tmp_path) is None


def test_the_largest_number_wins_not_the_name_order(tmp_path: Path) -> None:
    for step in (2, 10, 9):
        _save(tmp_path / f"step-{step}", step)
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step-10"
    model = nn.Linear(3, 2)
    assert load_checkpoint(latest_checkpoint(tmp_path), model) == 10  # type: ignore[arg-type]


def test_an_unfinished_save_is_skipped_and_kept(tmp_path: Path) -> None:
    _save(tmp_path / "step-3", 3)
    # A job killed after every rank wrote step 4 but before the swap: the staging
    # sibling is as complete as DCP makes it, and still not a checkpoint.
    _save(tmp_path / ".step-4.saving-checkpoint", 4)
    (tmp_path / ".step-5.saving-checkpoint").mkdir()  # killed before anything was written
    assert latest_checkpoint(tmp_path) == tmp_path / "step-3"
    assert (tmp_path / ".step-4.saving-checkpoint" / ".metadata").is_file()
    # The next save of that name removes its leftover.
    _save(tmp_path / "step-4", 4)
    assert not (tmp_path / ".step-4.saving-checkpoint").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4"


def test_what_is_not_a_complete_numbered_checkpoint_is_skipped(tmp_path: Path) -> None:
    _save(tmp_path / "step-1", 1)
    (tmp_path / "step-8").mkdir()  # no .metadata: not written by save_checkpoint
    (tmp_path / "step-9").write_text("a file")
    _save(tmp_path / "final", 99)  # no number at the end of the name
    (tmp_path / "notes.txt").write_text("mine")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"


def test_leading_zeros_count_as_numbers(tmp_path: Path) -> None:
    _save(tmp_path / "checkpoint-000100", 100)
    _save(tmp_path / "checkpoint-000020", 20)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-000100"


def test_two_checkpoints_with_the_same_number_are_refused(tmp_path: Path) -> None:
    _save(tmp_path / "step-3", 3)
    _save(tmp_path / "ckpt-3", 3)
    with pytest.raises(ValueError, match=r"\['ckpt-3', 'step-3'\] .* the same number 3"):
        latest_checkpoint(tmp_path)


def test_a_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        latest_checkpoint(tmp_path / "file")


@pytest.mark.parametrize("bad", [3, None, b"bytes"])
def test_a_root_of_another_type_is_refused(bad: object) -> None:
    with pytest.raises(TypeError, match=r"root must be a str or os\.PathLike"):
        latest_checkpoint(bad)  # type: ignore[arg-type]


def test_the_ranks_find_the_same_checkpoint(tmp_path: Path) -> None:
    run_on_gloo_ranks(rank_fns.shared_root, 2, str(tmp_path), timeout_s=120)
    found = {json.loads((tmp_path / f"shared{r}.json").read_text()) for r in range(2)}
    assert found == {str(tmp_path / "shared" / "step-12")}


def test_ranks_that_find_different_checkpoints_all_raise(tmp_path: Path) -> None:
    run_on_gloo_ranks(rank_fns.each_rank_sees_its_own_disk, 2, str(tmp_path), timeout_s=120)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [o["type"] for o in outcomes] == [CollectiveCallError.__name__] * 2, outcomes
    assert outcomes[0]["message"] == outcomes[1]["message"]
    assert "step-3 vs step-2" in outcomes[0]["message"]
    assert "a filesystem that every rank sees" in outcomes[0]["message"]
