"""The torchrun harness reports a failing scenario on its own (issue 18).

One launch of 2 ranks runs test-only scenarios (``mp/scenarios_harness_selftest.py``):
one fails cleanly on rank 1 (the launch goes on), one leaves rank 0 waiting in a
collective (the launch stops, the rest run in a fresh launch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import AGREE_TIMEOUT_ENV, EXTRA_SCENARIOS_ENV, run_scenarios

pytestmark = pytest.mark.distributed

MP_DIR = Path(__file__).parent / "mp"
SCENARIOS = [
    "harness_ok_first",
    "harness_fails_cleanly_on_rank1",
    "harness_ok_after_clean_failure",
    "harness_leaves_rank0_in_a_collective",
    "harness_ok_after_broken_group",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("harness")
    run_scenarios(
        MP_DIR / "worker.py",
        world_size=2,
        out=out,
        scenarios=SCENARIOS,
        env={
            EXTRA_SCENARIOS_ENV: "scenarios_harness_selftest",
            AGREE_TIMEOUT_ENV: "5",
            "FSDP_TEST_BACKEND": "gloo",  # the harness, not a backend, is under test
        },
        timeout_s=120.0,
    )
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in SCENARIOS}


def test_every_scenario_gets_a_result_or_its_own_error(
    results: dict[str, dict[str, Any]],
) -> None:
    for name in ("harness_ok_first", "harness_ok_after_clean_failure"):
        assert "error" not in results[name], results[name].get("error")
        assert results[name]["sum"] == 2.0
    for name in ("harness_fails_cleanly_on_rank1", "harness_leaves_rank0_in_a_collective"):
        assert "deliberate failure on rank 1" in results[name]["error"]
    assert "error" not in results["harness_ok_after_broken_group"]
    assert results["harness_ok_after_broken_group"]["sum"] == 2.0


def test_a_clean_failure_keeps_the_launch_and_a_broken_group_relaunches(
    results: dict[str, dict[str, Any]],
) -> None:
    assert "--- rank 1 ---" in results["harness_fails_cleanly_on_rank1"]["error"]
    assert results["harness_ok_after_clean_failure"]["launch"] == 0
    # Rank 1's probe all-reduce pairs with the one rank 0 waits in: the probe's sum is
    # wrong (or a rank is late), so the group counts as broken either way.
    assert "the launch stops here" in results["harness_leaves_rank0_in_a_collective"]["error"]
    assert results["harness_ok_after_broken_group"]["launch"] == 1
