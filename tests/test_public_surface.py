"""Each package's top level exports only the entry points a user needs.

Everything else is reachable from the documented submodules. The size targets
and the reference contracts (nemo-automodel's ``shared.multimodal_fsdp`` and
``models.deepseek_v41.fsdp`` pages) are fixed here: the contract names must be
importable from the top level.
"""

from __future__ import annotations

import importlib

import pytest

#: Most names a package's ``__all__`` may hold (``__version__`` included).
TARGETS = {"fsdp_core": 25, "multimodal_fsdp": 25, "model_deepseek_v41": 8}

CONTRACTS = {
    "multimodal_fsdp": (
        "_container_items",
        "_is_module_container",
        "_shard_layer_containers_recursively",
        "ignored_params_for_root",
        "is_multimodal_module_name",
        "iter_multimodal_modules",
        "module_is_fully_frozen",
        "module_parameters",
        "normalize_frozen_multimodal_sharding",
        "shard_multimodal_module",
        "FrozenMultimodalSharding",
        "MULTIMODAL_MODULE_NAMES",
        "MULTIMODAL_PROJECTOR_NAMES",
        "MULTIMODAL_TOWER_NAMES",
        "VALID_FROZEN_MULTIMODAL_SHARDING",
    ),
    "model_deepseek_v41": (
        "DeepseekV41ModelParallelizer",
        "PARALLELIZER",
        "fully_shard_deepseek_v41",
    ),
    "fsdp_core": (),
}


@pytest.mark.parametrize("package", sorted(TARGETS))
def test_top_level_is_within_its_target(package: str) -> None:
    module = importlib.import_module(package)
    assert len(module.__all__) <= TARGETS[package], (
        f"{package} exports {len(module.__all__)} names (target {TARGETS[package]}): "
        "keep new names in their submodule"
    )
    assert len(set(module.__all__)) == len(module.__all__)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ lists undefined names {missing}"


@pytest.mark.parametrize("package", sorted(TARGETS))
def test_every_contract_name_is_exported(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in CONTRACTS[package] if name not in module.__all__]
    assert not missing, f"{package} does not export the contract names {missing}"


def test_unread_media_defaults_are_gone() -> None:
    """``DEFAULT_MEDIA_INPUTS`` disagreed with ``structure.MEDIA_INPUTS`` and was read nowhere."""
    uneven = importlib.import_module("multimodal_fsdp.runtime.schedule_check")
    assert not hasattr(uneven, "DEFAULT_MEDIA_INPUTS")
