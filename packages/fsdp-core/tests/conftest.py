"""Shared fixtures for the fsdp-core unit tests.

Every fixture that initialises a process group tears it down again; the
repository's root conftest.py fails any test that leaves one behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core.fake_group import fake_process_group
from fsdp_core.mesh import build_mesh

#: Variables that make ``init_distributed`` think it runs under torchrun.
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No torchrun variables in the environment (restored after the test)."""
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not any(name in os.environ for name in TORCHRUN_ENV)
    return monkeypatch


@pytest.fixture
def fake_pg2() -> Iterator[None]:
    """A fake process group of world size 2."""
    with fake_process_group(2):
        yield


@pytest.fixture
def fake_pg4() -> Iterator[None]:
    """A fake process group of world size 4."""
    with fake_process_group(4):
        yield


@pytest.fixture
def mesh2(fake_pg2: None) -> DeviceMesh:
    """A 1-D ``("dp_shard",)`` CPU mesh of size 2 over the fake group."""
    return build_mesh()


@pytest.fixture
def mesh4(fake_pg4: None) -> DeviceMesh:
    """A 1-D ``("dp_shard",)`` CPU mesh of size 4 over the fake group."""
    return build_mesh()


@pytest.fixture
def hsdp_mesh(fake_pg4: None) -> DeviceMesh:
    """A 2x2 ``("dp_replicate", "dp_shard")`` CPU mesh over the fake group."""
    return build_mesh(dp_replicate=2)
