"""A call of the model on some ranks only fails on every waiting rank with an error that
names the ranks and their calls, within the collective timeout (issue 24, item 2).
Scenarios: tests/mp/scenarios_arrival.py (their mesh times out after 8 s)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from launches import MpResults

from fsdp_core.testing import run_torchrun

pytestmark = pytest.mark.distributed


def test_eval_on_one_rank_while_the_other_trains(mp2: MpResults) -> None:
    evaluating, training = mp2("arrival_eval_then_train")["outcomes"]
    # The evaluating rank sees at once that rank 1 made a training forward instead.
    assert evaluating["type"] == "CollectiveCallError"
    message = evaluating["message"]
    assert "rank 0 made a forward under torch.no_grad() as call #2" in message
    assert "rank 1 made a training forward as call #2" in message
    assert "run it on every rank" in message
    # The training rank meets the evaluating one at the same agreement: it raises the same
    # error at once (before, it was left in an all-gather until the group's timeout).
    assert training["type"] == "CollectiveCallError"
    assert training["message"] == message


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
    assert (training["type"], training["message"]) == ("CollectiveCallError", calling["message"])


def test_eval_on_every_rank_raises_nothing(mp2: MpResults) -> None:
    result = mp2("arrival_eval_everywhere")
    for outcomes in result["outcomes"]:
        assert [o["type"] for o in outcomes] == [""] * 6
    assert result["calls"] == [6, 6]
    assert result["points"] == [6, 6]  # every call met the other ranks (no media region)


def test_generate_with_an_empty_batch_on_one_rank(mp2: MpResults) -> None:
    full, empty = mp2("arrival_generate_empty_batch")["outcomes"]
    for outcome in (full, empty):
        assert outcome["type"] == "CollectiveCallError", outcome
        assert "generate() with an empty batch as call #1" in outcome["message"]
        assert "drop_last=True" in outcome["message"]


def test_a_rank_left_waiting_warns_names_the_missing_rank_and_gives_up(mp2: MpResults) -> None:
    # Issue 33, item 3. Before: rank 0 waited silently for the mesh's whole timeout (8 s
    # here, 30 min on gloo by default) and rank 1, coming to the call later, ran the
    # forward alone into an all-gather nobody joined.
    result = mp2("arrival_warns_then_gives_up")
    waiting, late = result["outcomes"]
    warnings = result["warnings"][0]
    assert warnings, "the waiting rank logged no warning"
    first = warnings[0]
    assert first.startswith("rank 0 has waited ")
    assert " s in call #2 of the model (a forward under torch.no_grad())" in first
    assert "for ranks [1], which have not made it yet" in first
    assert "rank 1: last made call #1, a training forward" in first
    assert "It gives up at " in first
    assert " UTC (4 s after it arrived" in first
    assert "FSDP_CORE_RANK_WAIT_TIMEOUT_S" in first
    assert result["warnings"][1] == []  # rank 1 did not wait
    # Then the waiting rank gives up at the setting (not the mesh's 8 s) ...
    assert waiting["type"] == "CollectiveCallError"
    assert "ranks [1] did not make call #2 within 4 s" in waiting["message"]
    assert "rank 1: #1, a training forward" in waiting["message"]
    # ... and the rank that comes to that call afterwards raises the same error.
    assert late["type"] == "CollectiveCallError"
    assert late["message"] == waiting["message"]


def test_a_slow_rank_is_warned_about_and_the_job_goes_on(mp2: MpResults) -> None:
    result = mp2("arrival_slow_rank_goes_on")
    for late_eval, next_step in result["outcomes"]:
        assert late_eval["type"] == "", late_eval
        assert next_step["type"] == "", next_step
    for together, late in result["losses"]:
        assert late == together  # the same forward, only later
    warnings = result["warnings"][0]
    assert warnings, "the waiting rank logged no warning"
    assert "rank 1: last made call #2, a forward under torch.no_grad()" in warnings[0]
    assert "(60 s after it arrived" in warnings[0]


def test_a_slow_rank_in_a_training_forward_is_warned_about(mp2: MpResults) -> None:
    # The sibling: a training forward waits at the same agreement as an eval forward (the
    # c10d store, polled), so it warns, names the rank and could give up; before, it
    # waited in an all-reduce until the group's timeout.
    result = mp2("arrival_slow_training_rank")
    for late_step, next_step in result["outcomes"]:
        assert late_step["type"] == "", late_step
        assert next_step["type"] == "", next_step
    warnings = result["warnings"][0]
    assert warnings, "the waiting rank logged no warning"
    first = warnings[0]
    assert " s in call #2 of the model (a training forward)" in first
    assert "for ranks [1], which have not made it yet" in first
    assert "rank 1: last made call #1, a training forward" in first
    assert "It gives up at " in first
    assert "(60 s after it arrived" in first
    assert result["warnings"][1] == []


#: The issue's script as a user writes it: nothing caught, rank 1 waits in a barrier.
EVAL_ON_RANK_0_ONLY = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    from fsdp_core import ModelParallelizer, build_mesh, init_distributed

    ctx = init_distributed(backend="gloo")  # the default 30-minute timeout
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ModelParallelizer().parallelize(net, mesh=build_mesh())
    net(torch.randn(4, 8)).square().mean().backward()
    if ctx.rank == 0:
        net.eval()
        net(torch.randn(4, 8))
    dist.barrier()
    print(f"rank {ctx.rank} went past the barrier", flush=True)
    """
)


def test_eval_on_rank_0_only_stops_the_job_instead_of_hanging(tmp_path: Path) -> None:
    # Before: rank 0 waited silently for the group's 30 minutes (the test's 120 s limit
    # ends it as a hang). Now it warns, gives up at the setting, and its error ends the
    # job: torchrun stops rank 1 in its barrier (or gloo raises there).
    script = tmp_path / "eval_on_rank_0_only.py"
    script.write_text(EVAL_ON_RANK_0_ONLY)
    env = {"FSDP_CORE_RANK_WAIT_WARN_S": "1", "FSDP_CORE_RANK_WAIT_TIMEOUT_S": "3"}
    with pytest.raises(AssertionError) as failed:
        run_torchrun(str(script), nproc=2, timeout_s=120, env=env)
    output = str(failed.value)
    assert "failed with exit code" in output, output[-3000:]
    assert "has waited" in output
    assert "rank 1: last made call #1, a training forward" in output
    assert "CollectiveCallError" in output
    assert "ranks [1] did not make call #2 within 3 s" in output
    assert "went past the barrier" not in output
