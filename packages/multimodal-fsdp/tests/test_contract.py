"""Behaviour that downstream frameworks pin: the reference implementation's contract.

The reference page (shared/reference/multimodal_fsdp_api.md) truncates the name tuples;
the full reference tables are spelled out here so that dropping or renaming one of them
fails a test. Our tables may hold more names, never fewer, and start in the reference's
order.
"""

from __future__ import annotations

import pytest
from torch import nn

from multimodal_fsdp import (
    MULTIMODAL_MODULE_NAMES,
    MULTIMODAL_PROJECTOR_NAMES,
    MULTIMODAL_TOWER_NAMES,
    VALID_FROZEN_MULTIMODAL_SHARDING,
    _container_items,
    _is_module_container,
    is_multimodal_module_name,
    iter_multimodal_modules,
    normalize_frozen_multimodal_sharding,
)

REFERENCE_TOWER_NAMES = (
    "visual",
    "vision_tower",
    "vision_model",
    "vit_model",
    "image_encoder",
    "vision_encoder",
    "audio_tower",
    "audio_encoder",
    "audio_model",
)
REFERENCE_PROJECTOR_NAMES = (
    "embed_vision",
    "embed_audio",
    "mm_projector",
    "multi_modal_projector",
    "multimodal_projector",
    "vision_projector",
    "vit_large_projector",
    "audio_projector",
)


def test_tower_table_is_a_superset_starting_with_the_reference_order() -> None:
    assert MULTIMODAL_TOWER_NAMES[: len(REFERENCE_TOWER_NAMES)] == REFERENCE_TOWER_NAMES


def test_projector_table_is_a_superset_starting_with_the_reference_order() -> None:
    prefix = MULTIMODAL_PROJECTOR_NAMES[: len(REFERENCE_PROJECTOR_NAMES)]
    assert prefix == REFERENCE_PROJECTOR_NAMES


def test_module_names_hold_every_reference_name() -> None:
    missing = set(REFERENCE_TOWER_NAMES + REFERENCE_PROJECTOR_NAMES) - set(MULTIMODAL_MODULE_NAMES)
    assert not missing


@pytest.mark.parametrize("name", REFERENCE_TOWER_NAMES + REFERENCE_PROJECTOR_NAMES)
def test_every_reference_name_is_a_multimodal_module_name(name: str) -> None:
    assert is_multimodal_module_name(name) is True


@pytest.mark.parametrize("name", ["vision_projector", "vit_large_projector", "audio_projector"])
def test_reference_projectors_are_found_as_maximal_modules(name: str) -> None:
    model = nn.Module()
    model.language_model = nn.Linear(2, 2)
    projector = nn.Sequential(nn.Linear(2, 2))
    setattr(model, name, projector)
    assert list(iter_multimodal_modules(model)) == [(name, projector)]


def test_valid_policies_match_the_reference() -> None:
    assert VALID_FROZEN_MULTIMODAL_SHARDING == ("root", "per_layer", "replicate")


@pytest.mark.parametrize("value", [3, None, "bogus", 1.5, b"root", ["root"]])
def test_every_bad_policy_is_a_value_error_naming_the_choices(value: object) -> None:
    with pytest.raises(ValueError, match="valid choices") as info:
        normalize_frozen_multimodal_sharding(value)  # type: ignore[arg-type]
    for choice in VALID_FROZEN_MULTIMODAL_SHARDING:
        assert choice in str(info.value)


@pytest.mark.parametrize(("value", "expected"), [("Per-Layer", "per_layer"), ("ROOT", "root")])
def test_policy_normalisation_the_reference_accepts(value: str, expected: str) -> None:
    assert normalize_frozen_multimodal_sharding(value) == expected


def test_container_items_enumerates_a_sequential() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert _container_items(nn.Sequential(a, b)) == [(0, a), (1, b)]


def test_container_items_of_the_reference_containers() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    assert _container_items(nn.ModuleList([a, b])) == [(0, a), (1, b)]
    assert _container_items(nn.ModuleDict({"x": a, "y": b})) == [("x", a), ("y", b)]


def test_only_lists_and_dicts_are_layer_containers() -> None:
    assert _is_module_container(nn.ModuleList()) is True
    assert _is_module_container(nn.ModuleDict()) is True
    assert _is_module_container(nn.Sequential()) is False


def test_vision_is_a_tower_name_as_in_the_reference() -> None:
    """nemo-automodel 0.7.0 lists ``vision`` among the tower names (DeepSeek-V4.1's tower)."""
    assert "vision" in MULTIMODAL_TOWER_NAMES
    model = nn.Module()
    model.vision = nn.Sequential(nn.Linear(2, 2))
    model.language_model = nn.Linear(2, 2)
    assert list(iter_multimodal_modules(model)) == [("vision", model.vision)]


def test_a_vision_module_inside_a_decoder_or_a_layer_is_no_tower() -> None:
    model = nn.Module()
    model.language_model = nn.Module()
    model.language_model.vision = nn.Linear(2, 2)
    model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    model.layers[0].vision = nn.Linear(2, 2)
    assert list(iter_multimodal_modules(model)) == []
