"""fsdp_core.collective_entry: every rank enters a collective call, and an error on one
rank is raised on all (2 spawned gloo ranks; no-ops under the fake group)."""

from __future__ import annotations

import errno
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fsdp_core.collective_count import CommCounter
from fsdp_core.collective_entry import enter_collective, group_ranks
from fsdp_core.fake_group import fake_process_group
from fsdp_core.rank_agreement import CollectiveCallError
from fsdp_core.testing import run_on_gloo_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _collective_entry_rank_fns as rank_fns


@pytest.fixture(scope="module")
def protocol(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("protocol")
    run_on_gloo_ranks(rank_fns.protocol_cases, 2, str(out), timeout_s=60)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_all_ranks_together_pass(protocol: list[dict[str, Any]]) -> None:
    assert [r["together"]["type"] for r in protocol] == [None, None]


def test_a_failure_on_one_rank_is_raised_on_every_rank(protocol: list[dict[str, Any]]) -> None:
    outcomes = [r["one_fails"] for r in protocol]
    assert [o["type"] for o in outcomes] == ["PermissionError", "PermissionError"]
    assert outcomes[0]["message"] == outcomes[1]["message"]
    assert "failed on rank 1 (writing)" in outcomes[0]["message"]
    # The errno and the file name travel too: PermissionError(13, text) on every rank.
    assert outcomes[0]["message"] == (
        "[Errno 13] fails failed on rank 1 (writing): Permission denied: '/x'"
    )


def test_a_rank_that_never_arrives_is_named_and_the_group_recovers(
    protocol: list[dict[str, Any]],
) -> None:
    alone = protocol[0]["alone"]
    assert alone["type"] == "CollectiveCallError"
    assert "alone is collective" in alone["message"]
    assert "ranks [1] did not arrive" in alone["message"]
    assert [r["after_alone"]["type"] for r in protocol] == [None, None]
    assert [r["after_alone_all_reduce"] for r in protocol] == [True, True]


def test_ranks_in_different_calls_name_each_other(protocol: list[dict[str, Any]]) -> None:
    outcomes = [r["different"] for r in protocol]
    assert [o["type"] for o in outcomes] == ["CollectiveCallError"] * 2
    for outcome in outcomes:
        assert (
            "rank 1 entered load_pretrained" in outcome["message"]
            or "rank 0 entered save_pretrained" in outcome["message"]
        )
    assert [r["after_different"]["type"] for r in protocol] == [None, None]


def test_differing_values_fail_on_every_rank(protocol: list[dict[str, Any]]) -> None:
    outcomes = [r["values"] for r in protocol]
    assert [o["type"] for o in outcomes] == ["CollectiveCallError"] * 2
    assert "rank 1's plan fingerprint differs from rank 0's" in outcomes[0]["message"]


def test_an_error_leaving_the_block_reaches_the_waiting_ranks(
    protocol: list[dict[str, Any]],
) -> None:
    outcomes = [r["escapes"] for r in protocol]
    assert [o["type"] for o in outcomes] == ["KeyError", "KeyError"]
    assert "failed on rank 1" in outcomes[0]["message"]
    assert [r["final_all_reduce"] for r in protocol] == [True, True]


def test_a_rank_that_never_arrives_is_warned_about_with_its_last_call(
    protocol: list[dict[str, Any]],
) -> None:
    # Issue 33, item 3: the waiting rank says who is missing and when it gives up.
    assert protocol[0]["warn_alone"]["type"] == "CollectiveCallError"
    first = protocol[0]["warn_alone_messages"][0]
    assert "in alone again (collective call #" in first
    assert "for ranks [1], which have not made it yet" in first
    assert "rank 1: last entered escapes (collective call #" in first
    assert "(1.5 s after it arrived; set FSDP_CORE_RANK_WAIT_TIMEOUT_S" in first
    assert protocol[1]["warn_alone_messages"] == []


def test_a_rank_late_to_a_step_is_warned_about_and_the_call_goes_on(
    protocol: list[dict[str, Any]],
) -> None:
    assert [r["warn_slow"]["type"] for r in protocol] == [None, None]
    first = protocol[0]["warn_slow_messages"][0]
    assert "in slow step (the step 'writing')" in first
    assert "rank 1: has not reached a step of slow step after its entry" in first


def test_a_bad_wait_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_CORE_RANK_WAIT_WARN_S", "-1")
    with pytest.raises(ValueError, match="FSDP_CORE_RANK_WAIT_WARN_S='-1'"):
        enter_collective("alone")


def test_no_op_without_a_group_or_under_the_fake_group() -> None:
    call = enter_collective("alone")
    assert not call.active
    with pytest.raises(OSError, match=r"pace|full") as raised:
        call.agree(OSError(errno.ENOSPC, "full"), step="write")
    assert raised.value.errno == errno.ENOSPC
    with fake_process_group(2), CommCounter() as counter:
        call = enter_collective("fake", timeout=timedelta(seconds=1))
        assert not call.active
        call.agree(step="nothing")
        call.agree_on("x", what="value")
        assert group_ranks() == (0, 1)
    assert counter.records == []


@pytest.mark.parametrize(
    ("timeout", "error"), [(0, ValueError), (-1.0, ValueError), ("3", TypeError), (True, TypeError)]
)
def test_bad_timeouts_are_refused(timeout: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout"):
        enter_collective("x", timeout=timeout)


def test_error_class_is_a_runtime_error() -> None:
    assert issubclass(CollectiveCallError, RuntimeError)


def test_group_ranks_of_an_hsdp_mesh_and_a_model() -> None:
    """Every rank of a 2-D mesh (a stand-in: building a real one here would leave
    torch's mesh cache pointing at a destroyed fake group for later tests)."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    hsdp = SimpleNamespace(mesh=torch.tensor([[2, 3], [4, 5]]))
    with fake_process_group(8):
        assert group_ranks(mesh=hsdp) == (2, 3, 4, 5)  # type: ignore[arg-type]
        assert group_ranks(model=nn.Linear(2, 2)) == tuple(range(8))  # not sharded: the world
    assert group_ranks() == ()
