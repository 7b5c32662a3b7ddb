"""Unit tests for multimodal_fsdp.discovery.walk on small hand-made module trees."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import pytest
from torch import nn

from multimodal_fsdp.discovery.names import (
    LANGUAGE_MODEL_NAMES,
    MULTIMODAL_MODULE_NAMES,
    MULTIMODAL_PROJECTOR_NAMES,
    MULTIMODAL_TOWER_NAMES,
    MultimodalModule,
    is_multimodal_module_name,
)
from multimodal_fsdp.discovery.walk import iter_multimodal_modules, resolve_multimodal_modules


class Tower(nn.Module):
    """A vision tower that itself contains tower- and projector-named parts."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_model = nn.Module()
        self.vision_model.encoder = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
        self.merger = nn.Linear(2, 2)


class DecoderLayer(nn.Module):
    """A text decoder layer with a cross-attention block named like a tower."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Linear(2, 2)
        self.cross_attn = nn.Module()
        self.cross_attn.vision_tower = nn.Linear(2, 2)
        self.projector = nn.Linear(2, 2)


class TextModel(nn.Module):
    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(4, 2)
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(num_layers)])
        self.norm = nn.LayerNorm(2)


class Core(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = Tower()
        self.multi_modal_projector = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Linear(2, 2))
        self.language_model = TextModel()


class Vlm(nn.Module):
    """LLaVA-shaped: model.{vision_tower, multi_modal_projector, language_model}, lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Core()
        self.lm_head = nn.Linear(2, 4)


def paths(model: nn.Module) -> list[str]:
    return [path for path, _ in iter_multimodal_modules(model)]


# --- name tuples -------------------------------------------------------------------------


def test_tower_names_start_with_the_contract_prefix() -> None:
    assert MULTIMODAL_TOWER_NAMES[:6] == (
        "visual",
        "vision_tower",
        "vision_model",
        "vit_model",
        "image_encoder",
        "vision_encoder",
    )
    assert MULTIMODAL_TOWER_NAMES[6:9] == ("audio_tower", "audio_encoder", "audio_model")
    assert "video_tower" in MULTIMODAL_TOWER_NAMES


def test_projector_names_start_with_the_contract_prefix() -> None:
    assert MULTIMODAL_PROJECTOR_NAMES[:5] == (
        "embed_vision",
        "embed_audio",
        "mm_projector",
        "multi_modal_projector",
        "multimodal_projector",
    )
    for name in ("aligner", "connector", "merger", "qformer", "language_projection"):
        assert name in MULTIMODAL_PROJECTOR_NAMES


def test_module_names_are_towers_then_projectors() -> None:
    assert MULTIMODAL_MODULE_NAMES == MULTIMODAL_TOWER_NAMES + MULTIMODAL_PROJECTOR_NAMES
    assert isinstance(MULTIMODAL_MODULE_NAMES, tuple)


def test_name_tuples_have_no_duplicates_or_overlap() -> None:
    assert len(set(MULTIMODAL_TOWER_NAMES)) == len(MULTIMODAL_TOWER_NAMES)
    assert len(set(MULTIMODAL_PROJECTOR_NAMES)) == len(MULTIMODAL_PROJECTOR_NAMES)
    assert not set(MULTIMODAL_TOWER_NAMES) & set(MULTIMODAL_PROJECTOR_NAMES)
    assert not set(MULTIMODAL_MODULE_NAMES) & set(LANGUAGE_MODEL_NAMES)
    assert all(name and "." not in name for name in MULTIMODAL_MODULE_NAMES)


# --- is_multimodal_module_name -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("vision_tower", True),
        ("model.vision_tower", True),
        ("thinker.model.audio_tower", True),
        ("model.multi_modal_projector", True),
        ("model.embed_vision", True),
        ("model.vision_tower.encoder", False),
        ("model.language_model", False),
        ("vision_tower_extra", False),
        ("model.layers.0.vision_x", False),
        # The name alone: the repeated-block guard needs the module tree (test_contract).
        ("model.layers.0.vision", True),
        ("", False),
        ("model.vision_tower.", False),
    ],
)
def test_is_multimodal_module_name_checks_the_last_component(name: str, expected: bool) -> None:
    assert is_multimodal_module_name(name) is expected


def test_is_multimodal_module_name_rejects_non_str() -> None:
    with pytest.raises(TypeError, match="name must be a str, got int"):
        is_multimodal_module_name(3)  # type: ignore[arg-type]


# --- the walk ------------------------------------------------------------------------------


def test_maximal_matches_hide_descendants() -> None:
    model = Vlm()
    found = dict(iter_multimodal_modules(model))
    assert list(found) == ["model.vision_tower", "model.multi_modal_projector"]
    assert found["model.vision_tower"] is model.model.vision_tower
    # The tower's own vision_model and merger are not reported separately.
    assert "model.vision_tower.vision_model" not in found
    assert "model.vision_tower.merger" not in found


def test_nested_match_found_when_parent_is_not_a_match() -> None:
    root = nn.Module()
    root.wrapper = nn.Module()
    root.wrapper.inner = nn.Module()
    root.wrapper.inner.audio_encoder = nn.Linear(2, 2)
    root.wrapper.inner.audio_encoder.visual = nn.Linear(2, 2)
    assert paths(root) == ["wrapper.inner.audio_encoder"]


def test_results_follow_named_modules_preorder() -> None:
    root = nn.Module()
    root.projector = nn.Linear(2, 2)
    root.audio_tower = nn.Linear(2, 2)
    root.visual = nn.Linear(2, 2)
    assert paths(root) == ["projector", "audio_tower", "visual"]


def test_root_is_never_yielded() -> None:
    tower = Tower()
    # The root's own children still count; the root itself does not.
    assert paths(tower) == ["vision_model", "merger"]
    assert paths(nn.Linear(2, 2)) == []


def test_decoder_layer_modules_are_not_towers() -> None:
    """Tower/projector names inside numbered decoder layers are false positives."""
    model = Vlm()
    found = paths(model)
    assert not any(".layers." in path for path in found)
    assert "model.language_model.layers.0.cross_attn.vision_tower" not in found
    assert "model.language_model.layers.0.projector" not in found


def test_repeated_block_guard_without_a_language_model_name() -> None:
    """The guard is structural: a decoder called ``decoder_stack`` is still protected."""
    root = nn.Module()
    root.decoder_stack = nn.ModuleList([DecoderLayer() for _ in range(2)])
    root.blocks = nn.Sequential(DecoderLayer())
    root.layer_dict = nn.ModuleDict({"0": DecoderLayer(), "1": DecoderLayer()})
    assert paths(root) == []


def test_named_container_items_are_attribute_like() -> None:
    """ModuleDict / OrderedDict-Sequential keys that are names are matched like attributes."""
    root = nn.Module()
    root.encoders = nn.ModuleDict({"vision_tower": nn.Linear(2, 2), "audio_tower": nn.Linear(2, 2)})
    root.pipeline = nn.Sequential(OrderedDict(visual=nn.Linear(2, 2), head=nn.Linear(2, 2)))
    assert paths(root) == ["encoders.vision_tower", "encoders.audio_tower", "pipeline.visual"]


def test_container_named_like_a_projector_is_yielded_whole() -> None:
    root = nn.Module()
    root.layerwise_projectors = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    assert paths(root) == ["layerwise_projectors"]


def test_language_model_subtree_is_guarded() -> None:
    """Helper modules kept by a text decoder outside its layer stack are not towers."""
    model = Vlm()
    model.model.language_model.visual = nn.Linear(2, 2)
    model.model.language_model.norm.connector = nn.Linear(2, 2)
    assert paths(model) == ["model.vision_tower", "model.multi_modal_projector"]


def test_guard_applies_to_language_model_only_strictly_below_it() -> None:
    """The guard keys on attribute names; a text model passed as the root has none."""
    text = TextModel()
    text.visual = nn.Linear(2, 2)
    assert paths(text) == ["visual"]


def test_text_only_model_has_no_multimodal_modules() -> None:
    assert paths(TextModel()) == []


def test_shared_modules_are_reported_once() -> None:
    root = nn.Module()
    tower = nn.Linear(2, 2)
    root.vision_tower = tower
    root.alias = nn.Module()
    root.alias.vision_tower = tower
    assert paths(root) == ["vision_tower"]


def test_iter_is_lazy_but_validates_eagerly() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got dict"):
        iter_multimodal_modules({"vision_tower": nn.Linear(2, 2)})  # type: ignore[arg-type]
    iterator = iter_multimodal_modules(Vlm())
    assert next(iterator)[0] == "model.vision_tower"


@pytest.mark.parametrize("bad", [None, "model", object(), [nn.Linear(2, 2)]])
def test_non_modules_raise_type_error_naming_the_type(bad: object) -> None:
    with pytest.raises(TypeError, match=type(bad).__name__):
        list(iter_multimodal_modules(bad))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=type(bad).__name__):
        resolve_multimodal_modules(bad)  # type: ignore[arg-type]


# --- resolver ------------------------------------------------------------------------------


def test_resolver_reports_role_modality_and_rule() -> None:
    model = Vlm()
    found = resolve_multimodal_modules(model)
    assert found == (
        MultimodalModule(
            "model.vision_tower", model.model.vision_tower, "tower", "vision", "name:vision_tower"
        ),
        MultimodalModule(
            "model.multi_modal_projector",
            model.model.multi_modal_projector,
            "projector",
            "vision",
            "name:multi_modal_projector",
        ),
    )


def test_resolver_and_iter_share_one_walk() -> None:
    model = Vlm()
    assert [(m.path, m.module) for m in resolve_multimodal_modules(model)] == list(
        iter_multimodal_modules(model)
    )


def test_multimodal_module_is_frozen() -> None:
    (first, *_) = resolve_multimodal_modules(Vlm())
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.path = "elsewhere"  # type: ignore[misc]


def test_projector_modality_is_inferred_from_sibling_towers() -> None:
    audio = nn.Module()
    audio.audio_tower = nn.Linear(2, 2)
    audio.multi_modal_projector = nn.Linear(2, 2)
    mixed = nn.Module()
    mixed.image_tower = nn.Linear(2, 2)
    mixed.video_tower = nn.Linear(2, 2)
    mixed.multi_modal_projector = nn.Linear(2, 2)
    lonely = nn.Module()
    lonely.connector = nn.Linear(2, 2)
    named = nn.Module()
    named.audio_tower = nn.Linear(2, 2)
    named.embed_vision = nn.Linear(2, 2)

    def modalities(model: nn.Module) -> dict[str, str]:
        return {m.path: m.modality for m in resolve_multimodal_modules(model)}

    assert modalities(audio) == {"audio_tower": "audio", "multi_modal_projector": "audio"}
    assert modalities(mixed)["multi_modal_projector"] == "unknown"
    assert modalities(lonely) == {"connector": "unknown"}
    # A projector whose name carries a modality keeps it, whatever its neighbours are.
    assert modalities(named)["embed_vision"] == "vision"


def test_extra_names_add_towers_and_projectors() -> None:
    root = nn.Module()
    root.my_speech_encoder = nn.Linear(2, 2)
    root.my_bridge = nn.Linear(2, 2)
    root.text = TextModel()
    found = resolve_multimodal_modules(
        root, extra_tower_names=["my_speech_encoder"], extra_projector_names=("my_bridge",)
    )
    assert [(m.path, m.role, m.modality, m.rule) for m in found] == [
        ("my_speech_encoder", "tower", "audio", "extra:my_speech_encoder"),
        ("my_bridge", "projector", "audio", "extra:my_bridge"),
    ]
    # Built-in discovery does not know these names.
    assert paths(root) == []


def test_extra_names_obey_maximality_and_guards() -> None:
    root = Vlm()
    root.model.vision_tower.encoder = nn.Linear(2, 2)
    found = resolve_multimodal_modules(root, extra_tower_names=("self_attn", "encoder"))
    # Hidden by the vision tower, or inside decoder layers.
    assert [m.path for m in found] == ["model.vision_tower", "model.multi_modal_projector"]


def test_extra_name_equal_to_a_builtin_of_the_same_role_is_accepted() -> None:
    found = resolve_multimodal_modules(Vlm(), extra_tower_names=("vision_tower",))
    assert found[0].rule == "name:vision_tower"


def test_extra_names_conflicting_roles_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"both extra tower and extra projector names: \['enc'\]"):
        resolve_multimodal_modules(Vlm(), extra_tower_names=["enc"], extra_projector_names=["enc"])
    with pytest.raises(ValueError, match="'connector' is already a built-in projector name"):
        resolve_multimodal_modules(Vlm(), extra_tower_names=["connector"])
    with pytest.raises(ValueError, match="'visual' is already a built-in tower name"):
        resolve_multimodal_modules(Vlm(), extra_projector_names=["visual"])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"extra_tower_names": "vision"}, TypeError, "extra_tower_names must be a collection"),
        ({"extra_projector_names": 5}, TypeError, "extra_projector_names must be a collection"),
        ({"extra_tower_names": [b"x"]}, TypeError, "entries must be str, got bytes"),
        ({"extra_tower_names": ["a.b"]}, ValueError, "without dots, got 'a.b'"),
        ({"extra_projector_names": [""]}, ValueError, "without dots, got ''"),
        ({"exclude": "model.vision_tower"}, TypeError, "exclude must be a collection of str"),
        ({"exclude": [None]}, TypeError, "exclude entries must be str, got NoneType"),
        ({"exclude": [""]}, ValueError, "qualified module paths, got ''"),
        ({"exclude": ["model..x"]}, ValueError, "qualified module paths, got 'model..x'"),
    ],
)
def test_resolver_validates_arguments(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        resolve_multimodal_modules(Vlm(), **kwargs)  # type: ignore[arg-type]


def test_exclude_skips_the_path_and_its_descendants() -> None:
    model = Vlm()
    found = resolve_multimodal_modules(model, exclude=["model.vision_tower"])
    # The tower's inner vision_model/merger must not surface once the tower is excluded.
    assert [m.path for m in found] == ["model.multi_modal_projector"]


def test_exclude_of_a_non_matching_ancestor_skips_everything_below() -> None:
    assert resolve_multimodal_modules(Vlm(), exclude=("model",)) == ()


def test_exclude_inside_a_match_is_accepted() -> None:
    found = resolve_multimodal_modules(Vlm(), exclude=["model.vision_tower.merger"])
    assert [m.path for m in found] == ["model.vision_tower", "model.multi_modal_projector"]


def test_unknown_exclude_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"exclude paths \['model.vision_towr'\] do not name"):
        resolve_multimodal_modules(Vlm(), exclude=["model.vision_tower", "model.vision_towr"])
    with pytest.raises(ValueError, match="of Vlm"):
        resolve_multimodal_modules(Vlm(), exclude=["vision_tower"])


def test_matches_are_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="multimodal_fsdp.discovery.walk"):
        resolve_multimodal_modules(Vlm(), exclude=["model.multi_modal_projector"])
    text = caplog.text
    assert "found tower model.vision_tower" in text
    assert "skipping excluded subtree model.multi_modal_projector" in text
