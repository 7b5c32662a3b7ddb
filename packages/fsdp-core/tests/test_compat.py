"""fsdp_core.compat: capability flags by introspection."""

from __future__ import annotations

import pytest
import torch

from fsdp_core import compat

FLAG_NAMES = (
    "FSDP2_AVAILABLE",
    "FULLY_SHARD_IGNORED_PARAMS",
    "FULLY_SHARD_GROUPED_MODULES",
    "GROUPED_PER_MODULE_CASTING",
    "GROUPED_UNIT_REUSE",
    "REDUCE_SCATTER_UNUSED_PARAMS",
    "FAKE_PROCESS_GROUP",
)


@pytest.mark.parametrize("name", FLAG_NAMES)
def test_every_flag_is_a_bool(name: str) -> None:
    assert type(getattr(compat, name)) is bool


def test_capabilities_lists_every_flag() -> None:
    caps = compat.capabilities()
    assert set(caps) == set(FLAG_NAMES)
    for name, value in caps.items():
        assert value is getattr(compat, name)
    # The exported flags are exactly the capabilities plus the version and the function.
    assert set(compat.__all__) == {*FLAG_NAMES, "TORCH_VERSION", "capabilities"}


def test_capabilities_returns_a_fresh_dict() -> None:
    caps = compat.capabilities()
    caps["FSDP2_AVAILABLE"] = not caps["FSDP2_AVAILABLE"]
    assert compat.capabilities()["FSDP2_AVAILABLE"] is compat.FSDP2_AVAILABLE


def test_torch_version_matches_installed_torch() -> None:
    major, minor = compat.TORCH_VERSION
    assert isinstance(major, int)
    assert isinstance(minor, int)
    assert torch.__version__.startswith(f"{major}.{minor}")


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.13.0+cpu", (2, 13)), ("2.14.0a0+git1234", (2, 14)), ("3.0.1", (3, 0))],
)
def test_torch_version_parsing(
    monkeypatch: pytest.MonkeyPatch, version: str, expected: tuple[int, int]
) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    assert compat._torch_version() == expected


def test_grouped_casting_implies_grouped_modules() -> None:
    if compat.GROUPED_PER_MODULE_CASTING:
        assert compat.FULLY_SHARD_GROUPED_MODULES
    if compat.FULLY_SHARD_GROUPED_MODULES or compat.FULLY_SHARD_IGNORED_PARAMS:
        assert compat.FSDP2_AVAILABLE


@pytest.mark.skipif(compat.TORCH_VERSION < (2, 13), reason="flags checked on torch >= 2.13")
def test_torch_2_13_has_every_feature() -> None:
    assert compat.FSDP2_AVAILABLE
    assert compat.FULLY_SHARD_IGNORED_PARAMS
    assert compat.FULLY_SHARD_GROUPED_MODULES
    assert compat.GROUPED_PER_MODULE_CASTING
    assert compat.REDUCE_SCATTER_UNUSED_PARAMS
    assert compat.FAKE_PROCESS_GROUP


def test_flags_agree_with_torch() -> None:
    from torch.distributed.fsdp import FSDPModule

    expected = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
    assert expected == compat.REDUCE_SCATTER_UNUSED_PARAMS
