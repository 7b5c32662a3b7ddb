"""A job that torchrun restarts resumes from its newest complete checkpoint and ends
bit-identical to a run that was never interrupted (issue 33, item 4).

One launch of ``tests/mp/restart_job.py`` on 2 CPU ranks with ``--max-restarts 10``:
on each of the first 10 attempts one rank SIGKILLs itself at another point (``KILLS``:
after step 3, around ``init_distributed``, inside a forward, an optimizer step,
``latest_checkpoint``, ``load_checkpoint``, and in the middle of ``save_checkpoint``),
torchrun restarts both ranks on the same rendezvous store, and the job resumes from
``latest_checkpoint``. Before each start of the group got a fresh store prefix, the
first restart read the dead attempt's gloo addresses ("Gloo connectFullMesh failed ...
Connection refused") or hung. Cost: 11 starts of 2 ranks, about 70 s of CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from restart_job import KILLS, STEPS

from fsdp_core.checkpoint import latest_checkpoint
from fsdp_core.testing import TORCHRUN_ENV, _stop, free_port

pytestmark = pytest.mark.distributed

JOB = Path(__file__).parent / "mp" / "restart_job.py"
NODES_JOB = Path(__file__).parent / "mp" / "restart_nodes_job.py"
RESTARTS = 10
#: A hang fails the test instead of stalling CI (the job takes ~40 s on 2 idle cores).
TIMEOUT_S = 480.0
#: Attempt -> the checkpoint it resumed from (attempts killed before they got there are
#: absent): step 3 after the kill after step 3; step 4, not the unfinished step 5 that
#: attempt 3 left in ``.step-5.saving-checkpoint`` with a complete ``.metadata``.
RESUMED_FROM = {
    0: None,
    3: "step-3",
    4: "step-4",
    6: "step-4",
    7: "step-4",
    9: "step-6",
    10: "step-6",
}


def _torchrun(*options: str) -> subprocess.Popen[str]:
    """Start ``torchrun <options>`` in its own session (so a hang can be killed whole)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.1"]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [*command, *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen[str], timeout_s: float) -> tuple[int, str]:
    """Its exit code and output; a torchrun still running after ``timeout_s`` fails the
    test, stopped the way ``run_torchrun`` stops one: SIGTERM first, so that it stops its
    workers (they run in sessions of their own), then SIGKILL."""
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        output, _ = _stop(process)
        pytest.fail(f"the restarted job did not finish within {timeout_s:.0f} s\n{output[-20000:]}")
    return process.returncode, output


def _launch(out: Path) -> subprocess.CompletedProcess[str]:
    options = ["--standalone", "--nproc-per-node=2", f"--max-restarts={RESTARTS}"]
    returncode, output = _finish(_torchrun(*options, str(JOB), str(out)), TIMEOUT_S)
    return subprocess.CompletedProcess(options, returncode, output, "")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("restarts")
    result = _launch(out)
    logs = {
        rank: [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
        for rank in range(2)
    }
    return {"out": out, "result": result, "logs": logs}


def test_the_job_came_back_after_each_of_10_kills(job: dict[str, Any]) -> None:
    result = job["result"]
    assert result.returncode == 0, result.stdout[-20000:]
    assert "connectFullMesh" not in result.stdout
    for rank, entries in job["logs"].items():
        started = [e["attempt"] for e in entries if "started" in e]
        assert started == list(range(RESTARTS + 1)), (rank, started)
        killed = {e["attempt"]: e["killed"] for e in entries if "killed" in e}
        assert killed == {a: where for a, (r, where) in KILLS.items() if r == rank}
        assert [e["attempt"] for e in entries if "finished" in e] == [RESTARTS]


def test_each_attempt_resumed_from_the_newest_complete_checkpoint(job: dict[str, Any]) -> None:
    for entries in job["logs"].values():
        resumed = {e["attempt"]: e["resumed_from"] for e in entries if "resumed_from" in e}
        assert resumed == RESUMED_FROM
        leftovers = {e["attempt"]: e["leftovers"] for e in entries if "leftovers" in e}
        # Killed after every rank wrote step 5, before it was moved into place:
        assert leftovers[4] == [[".step-5.saving-checkpoint", True]]
        assert leftovers[9] == []  # the next save of step 5 removed it
    root = job["out"] / "checkpoints"
    assert latest_checkpoint(root) == root / f"step-{STEPS}"
    assert not list(root.glob(".*"))


def test_losses_are_bit_identical_to_an_uninterrupted_run(job: dict[str, Any]) -> None:
    for rank, entries in job["logs"].items():
        reference = {e["reference_step"]: e["loss"] for e in entries if "reference_step" in e}
        assert sorted(reference) == list(range(1, STEPS + 1))
        trained: dict[int, set[str]] = defaultdict(set)
        for entry in entries:
            if "step" in entry:
                trained[entry["step"]].add(entry["loss"])  # every replay of a step
        assert {step: {reference[step]} for step in reference} == dict(trained), rank


def test_weights_are_bit_identical_to_an_uninterrupted_run(job: dict[str, Any]) -> None:
    weights = torch.load(job["out"] / "weights.pt")
    resumed, reference = weights["resumed"], weights["reference"]
    assert resumed
    assert resumed.keys() == reference.keys()
    different = [name for name in resumed if not torch.equal(resumed[name], reference[name])]
    assert not different


def test_two_nodes_whose_restart_counts_differ_meet_again(tmp_path: Path) -> None:
    # After rank 1's node restarts it (count 1), rank 0's node restarts for the
    # membership change without counting (count 0): a store prefix made from the count
    # would keep the two apart (measured: the stale prefix of the first attempt failed the
    # restarted one, "Gloo connectFullMesh failed", and cost a second restart).
    endpoint = f"127.0.0.1:{free_port()}"
    options = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d"]
    options += [f"--rdzv-endpoint={endpoint}", "--rdzv-id=restart-nodes"]
    nodes = [_torchrun(*options, str(NODES_JOB), str(tmp_path)) for _ in range(2)]
    finished = [_finish(node, 240.0) for node in nodes]
    assert [code for code, _ in finished] == [0, 0], (
        finished[0][1][-10000:] + finished[1][1][-10000:]
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(result["restart_count"] for result in results) == [0, 1]
    assert [result["total"] for result in results] == [6.0, 6.0]
