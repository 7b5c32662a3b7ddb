"""Fixtures for every test tree of the repository (tests/ and packages/*/tests).

pytest runs from the repository root with the root pyproject.toml (nox, CI), so this
file is loaded for each tree; test trees cannot import from each other, so a fixture
every tree needs lives here, once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_leak() -> Iterator[None]:
    """Fail (and clean up) a test that leaves a process group initialised, so the
    next test does not run inside it."""
    assert not dist.is_initialized(), "a process group leaked into this test"
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            pytest.fail("the test left a process group initialised")
