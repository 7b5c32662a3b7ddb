"""Shared fixtures: one torchrun launch per world size runs every scenario of the suite.

torchrun start-up costs ~5 s, so instead of one launch per assertion the suite
launches ``tests/mp/worker.py`` once per world size (and backend) with all the
scenarios listed in ``mp/launches.py``, and the tests read the saved results.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

MP_DIR = Path(__file__).parent / "mp"
#: Comma-separated scenario names: launch only these (a quick loop on a few scenarios;
#: tests reading another scenario then skip). Unset: every scenario of the launch.
ONLY_ENV = "FSDP_TEST_ONLY"
sys.path.insert(0, str(MP_DIR))

from harness import run_scenarios  # noqa: E402
from launches import LAUNCHES, MP_TIMEOUT_S, NEEDS_PREVIOUS, MpResults  # noqa: E402


def _launch(
    world_size: int, out: Path, backend: str | None, previous: Path | None, scenarios: list[str]
) -> None:
    """Run ``scenarios``; a launch that stops early is relaunched with the rest."""
    env = {"FSDP_TEST_BACKEND": backend} if backend else {}
    if previous is not None:
        env["FSDP_TEST_PREVIOUS_OUT"] = str(previous)
    run_scenarios(
        MP_DIR / "worker.py",
        world_size=world_size,
        out=out,
        scenarios=scenarios,
        env=env,
        timeout_s=MP_TIMEOUT_S,
    )


def _results_fixture(world_size: int, after: str | None = None) -> Any:
    """A session fixture launching ``world_size`` ranks once; ``after`` names the fixture
    whose launch must finish first (its output directory is passed on, e.g. for loading
    a checkpoint saved on another number of ranks)."""

    @pytest.fixture(scope="session")
    def fixture(
        request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> MpResults:
        backend = os.environ.get("FSDP_TEST_BACKEND") or None
        _skip_without_gpus(backend, world_size)
        previous = None
        if after is not None:
            try:
                previous = request.getfixturevalue(after).out  # type: ignore[attr-defined]
            except pytest.skip.Exception:
                previous = None  # e.g. 2 GPUs under NCCL: no 4-rank launch to load from
        only = {n for n in os.environ.get(ONLY_ENV, "").split(",") if n}
        scenarios = [
            name
            for name in LAUNCHES[world_size]
            if (previous or name not in NEEDS_PREVIOUS) and (not only or name in only)
        ]
        if not scenarios:
            pytest.skip(f"{ONLY_ENV} selects no scenario of the {world_size}-rank launch")
        out = tmp_path_factory.mktemp(f"mp{world_size}")
        _launch(world_size, out, backend, previous, scenarios)

        def load(name: str) -> dict[str, Any]:
            if name not in LAUNCHES[world_size]:
                raise KeyError(f"scenario {name!r} is not launched on {world_size} ranks")
            if name not in scenarios:
                why = "is not in " + ONLY_ENV if only else f"needs the output of the {after} launch"
                pytest.skip(f"scenario {name!r} {why}")
            result: dict[str, Any] = torch.load(out / f"{name}.pt", weights_only=False)
            if "error" in result:
                pytest.fail(f"scenario {name} failed on the ranks:\n{result['error']}")
            return result

        load.out = out  # type: ignore[attr-defined]
        return load

    return fixture


def _skip_without_gpus(backend: str | None, world_size: int) -> None:
    if backend != "nccl":
        if world_size == 1:
            pytest.skip("world-size-1 launches run only under FSDP_TEST_BACKEND=nccl")
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < world_size:
        pytest.skip(
            f"FSDP_TEST_BACKEND=nccl needs {world_size} CUDA GPUs for this launch, found {gpus}"
        )


mp1 = _results_fixture(1)
mp4 = _results_fixture(4)
mp2 = _results_fixture(2, after="mp4")
