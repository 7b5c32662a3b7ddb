"""Structural discovery rules on hand-made module trees (no transformers needed).

Transformers-style models are imitated by duck typing, exactly what discovery looks at: a
``main_input_name`` class attribute, a ``config`` with ``model_type`` and ``to_dict``, and
sub-configs stored as attributes of that config.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multimodal_fsdp.discovery.names import MultimodalModule
from multimodal_fsdp.discovery.walk import iter_multimodal_modules, resolve_multimodal_modules


class Config:
    """A config: ``model_type``, ``to_dict`` and any sub-configs as attributes."""

    def __init__(self, model_type: str, **subconfigs: Config) -> None:
        self.model_type = model_type
        for name, value in subconfigs.items():
            setattr(self, name, value)

    def to_dict(self) -> dict[str, object]:
        return dict(vars(self))


class PixelEncoder(nn.Module):
    """A vision model: media in, no text."""

    main_input_name = "pixel_values"

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = config or Config("vit")
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return pixel_values


class FeatureEncoder(PixelEncoder):
    main_input_name = "input_features"

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return input_features


class HiddenEncoder(PixelEncoder):
    """A tower whose main input is not a media name: only its config tells."""

    main_input_name = "input_ids"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return hidden_states


class TextDecoder(nn.Module):
    """A decoder: takes text and cross-attends (even if its main input were media)."""

    main_input_name = "pixel_values"

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = config or Config("text")
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])

    def forward(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        return input_ids


class PatchEmbed(nn.Module):
    """A patch projection: media in, no layer stack."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)


class StackedPatchEncoder(PatchEmbed):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(2, 2)])


class FeatureProjector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, audio_features: torch.Tensor) -> torch.Tensor:
        return self.linear(audio_features)


class Hub(nn.Module):
    """Where media meets text: forward takes both, no layer list of its own."""

    main_input_name = "input_ids"

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = config or Config("hub")

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return input_ids


class Seq2Seq(Hub):
    """A whole encoder-decoder: media main input, but also decoder inputs."""

    main_input_name = "input_features"

    def forward(  # type: ignore[override]
        self, input_features: torch.Tensor, decoder_input_ids: torch.Tensor
    ) -> torch.Tensor:
        return input_features


def found(model: nn.Module, **kwargs: object) -> dict[str, str]:
    return {
        item.path: f"{item.role}/{item.modality}/{item.rule}"
        for item in resolve_multimodal_modules(model, **kwargs)  # type: ignore[arg-type]
    }


# --- main_input ----------------------------------------------------------------------------


def test_model_with_a_media_main_input_is_a_tower() -> None:
    root = nn.Module()
    root.encoder = PixelEncoder()
    assert found(root) == {"encoder": "tower/vision/main_input:pixel_values"}


def test_audio_main_input_gives_an_audio_tower() -> None:
    root = nn.Module()
    root.encoder = FeatureEncoder()
    assert found(root) == {"encoder": "tower/audio/main_input:input_features"}


def test_a_media_main_input_with_text_arguments_is_not_a_tower() -> None:
    """A whole sequence-to-sequence model has a media main input and decoder inputs."""
    root = nn.Module()
    root.model = Seq2Seq()
    root.model.encoder = FeatureEncoder()
    assert found(root) == {"model.encoder": "tower/audio/main_input:input_features"}


def test_a_cross_attending_decoder_is_not_a_tower() -> None:
    root = nn.Module()
    root.decoder = TextDecoder()
    assert found(root) == {}


def test_main_input_name_without_a_config_is_not_a_model() -> None:
    root = nn.Module()
    root.encoder = PixelEncoder()
    del root.encoder.config
    assert "encoder" not in found(root)


# --- sub-configs ---------------------------------------------------------------------------


def vlm_with_configs(encoder_attr: str, encoder_type: str) -> nn.Module:
    encoder_config = Config(encoder_type)
    text_config = Config("llama")
    root = Hub(Config("vlm", **{encoder_attr: encoder_config, "text_config": text_config}))
    root.encoder = HiddenEncoder(encoder_config)
    root.decoder = TextDecoder(text_config)
    return root


@pytest.mark.parametrize(
    ("attr", "model_type", "modality"),
    [
        ("vision_config", "anything", "vision"),
        ("audio_config", "anything", "audio"),
        ("speech_encoder_config", "anything", "audio"),
        ("encoder_config", "granite_speech_encoder", "audio"),
        ("encoder", "vit", "vision"),
        ("encoder", "wav2vec2", "audio"),
    ],
)
def test_model_built_from_a_media_subconfig_is_a_tower(
    attr: str, model_type: str, modality: str
) -> None:
    root = vlm_with_configs(attr, model_type)
    assert found(root) == {
        "encoder": f"tower/{modality}/config:{attr.removesuffix('_config')}_config"
    }


@pytest.mark.parametrize(
    ("attr", "model_type"),
    [("encoder", "t5_encoder"), ("encoder_config", "text_encoder"), ("token2wav_config", "x")],
)
def test_non_media_subconfigs_are_not_towers(attr: str, model_type: str) -> None:
    """A neutral encoder config of a text type, or an output vocoder, is not a tower."""
    assert found(vlm_with_configs(attr, model_type)) == {}


def test_subconfig_must_be_the_same_object() -> None:
    """An equal-looking config is not enough: the module must be built from the sub-config."""
    root = vlm_with_configs("vision_config", "siglip")
    root.encoder.config = Config("siglip")
    assert found(root) == {}


def test_nothing_is_found_inside_a_model_built_from_the_text_config() -> None:
    root = vlm_with_configs("vision_config", "siglip")
    root.decoder.helper = PixelEncoder()
    root.decoder.vision_tower = nn.Linear(2, 2)
    assert list(found(root)) == ["encoder"]


# --- forward signatures --------------------------------------------------------------------


def test_media_encoder_child_of_the_media_entry_is_a_tower() -> None:
    root = Hub()
    root.image_encoder_like = StackedPatchEncoder()
    assert found(root) == {"image_encoder_like": "tower/vision/forward:pixel_values"}


def test_bare_patch_projection_at_the_media_entry_is_not_reported() -> None:
    """Without layers of its own it embeds patches for a single-stream text model."""
    root = Hub()
    root.patch_embed = PatchEmbed()
    assert found(root) == {}


def test_structural_match_sharing_a_parameter_outside_itself_is_dropped() -> None:
    """Tied weights: the encoder's projection is also registered in the text model."""
    root = Hub()
    root.image_encoder_like = StackedPatchEncoder()
    root.text = nn.Module()
    root.text.proj = nn.Linear(2, 2)
    root.text.proj.weight = root.image_encoder_like.proj.weight
    assert found(root) == {}
    del root.text
    assert list(found(root)) == ["image_encoder_like"]


def test_parameter_registered_twice_inside_the_match_is_not_sharing() -> None:
    root = Hub()
    root.image_encoder_like = StackedPatchEncoder()
    encoder = root.image_encoder_like
    encoder.blocks[0].weight = encoder.proj.weight
    assert list(found(root)) == ["image_encoder_like"]


def test_tower_output_consumer_is_a_projector() -> None:
    root = Hub()
    root.adapter = FeatureProjector()
    assert found(root) == {"adapter": "projector/audio/features:audio_features"}


def test_forward_rule_needs_a_parent_where_media_meets_text() -> None:
    root = nn.Module()  # forward takes nothing known
    root.encoder_like = StackedPatchEncoder()
    root.adapter = FeatureProjector()
    assert found(root) == {}


def test_forward_rule_skips_the_inside_of_a_text_stack() -> None:
    """A module owning its layer list and taking text and pixels is a text stack."""
    root = Hub()
    root.encoder_like = StackedPatchEncoder()
    assert list(found(root)) == ["encoder_like"]
    root.layers = nn.ModuleList([nn.Linear(2, 2)])
    assert found(root) == {}


def test_forward_rule_needs_parameters() -> None:
    class Parameterless(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList([nn.Identity()])

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return pixel_values

    root = Hub()
    root.resize = Parameterless()
    assert found(root) == {}


# --- guards apply to structural rules too -------------------------------------------------


def test_structural_matches_never_come_from_numbered_layers() -> None:
    root = Hub()
    root.blocks = nn.ModuleList([nn.Module()])
    root.blocks[0].encoder = PixelEncoder()
    root.blocks[0].encoder_like = StackedPatchEncoder()
    assert found(root) == {}


def test_structural_matches_never_come_from_a_named_language_model() -> None:
    root = Hub()
    root.language_model = nn.Module()
    root.language_model.encoder = PixelEncoder()
    assert found(root) == {}


def test_names_win_over_structure_and_keep_maximality() -> None:
    root = Hub()
    root.vision_tower = PixelEncoder()
    root.vision_tower.inner = FeatureEncoder()
    assert found(root) == {"vision_tower": "tower/vision/name:vision_tower"}


def test_structural_false_keeps_name_matching_only() -> None:
    root = Hub()
    root.encoder = PixelEncoder()
    root.vision_tower = nn.Linear(2, 2)
    assert list(found(root, structural=False)) == ["vision_tower"]
    assert list(found(root)) == ["encoder", "vision_tower"]


def test_structural_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="structural must be a bool"):
        resolve_multimodal_modules(nn.Module(), structural="yes")  # type: ignore[arg-type]


def test_text_only_tree_yields_nothing() -> None:
    root = nn.Module()
    root.model = TextDecoder()
    root.model.embed_tokens = nn.Embedding(4, 2)
    root.lm_head = nn.Linear(2, 4)
    assert found(root) == {}
    assert list(iter_multimodal_modules(root)) == []


# --- bundles -------------------------------------------------------------------------------


class MediaEncoder(nn.Module):
    """An encoder made of towers: media in (every media input required), no text."""

    def forward(self, pixel_values: torch.Tensor, input_features: torch.Tensor) -> torch.Tensor:
        return pixel_values


class ImageEncoder(nn.Module):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return pixel_values


class FeatureEmbedding(nn.Module):
    """Phi-4-multimodal's shape: the text stream in, each encoder called only with its media."""

    def forward(
        self,
        input_ids: torch.Tensor,
        inputs_embeds: torch.Tensor,
        image_pixel_values: torch.Tensor | None = None,
        audio_input_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return inputs_embeds


class OptionalMedia(nn.Module):
    """No text, but either medium may be missing: it may run one tower and not the other."""

    def forward(
        self, pixel_values: torch.Tensor | None = None, input_features: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return pixel_values


def bundle_model(holder: type[nn.Module] = MediaEncoder) -> nn.Module:
    root = Hub()
    root.layers = nn.ModuleList([nn.Linear(2, 2)])
    root.extra_embeddings = holder()
    root.extra_embeddings.image_embed = nn.Linear(2, 2)
    root.extra_embeddings.audio_embed = nn.Linear(2, 2)
    return root


def test_an_encoder_holding_only_towers_is_reported_as_one_tower() -> None:
    items = resolve_multimodal_modules(bundle_model())
    assert [(i.path, i.role, i.modality, i.rule) for i in items] == [
        ("extra_embeddings", "tower", "unknown", "bundle:image_embed+audio_embed")
    ]
    assert isinstance(items[0], MultimodalModule)


def test_bundle_of_one_modality_keeps_it() -> None:
    root = nn.Module()
    root.lm = nn.Linear(2, 2)
    root.towers = ImageEncoder()
    root.towers.vision_tower = nn.Linear(2, 2)
    root.towers.image_tower = nn.Linear(2, 2)
    assert found(root) == {"towers": "tower/vision/bundle:vision_tower+image_tower"}


@pytest.mark.parametrize(
    "holder",
    [FeatureEmbedding, OptionalMedia, nn.Module],
    ids=["takes-text", "optional-media", "plain-container"],
)
def test_no_bundle_when_its_call_does_not_run_its_towers(holder: type[nn.Module]) -> None:
    """A module every batch runs (it takes the text stream), one that may run some of its
    towers only, and a container that is never called: the towers are what runs with
    media, so they are reported (a rank that enters the holder may run none of them)."""
    items = resolve_multimodal_modules(bundle_model(holder))
    assert [(i.path, i.modality, i.rule) for i in items] == [
        ("extra_embeddings.image_embed", "vision", "name:image_embed"),
        ("extra_embeddings.audio_embed", "audio", "name:audio_embed"),
    ]


def test_no_bundle_when_a_sibling_with_parameters_is_not_a_tower() -> None:
    root = bundle_model()
    root.extra_embeddings.mixer = nn.Linear(2, 2)
    assert list(found(root)) == ["extra_embeddings.image_embed", "extra_embeddings.audio_embed"]


def test_parameterless_siblings_do_not_prevent_a_bundle() -> None:
    root = bundle_model()
    root.extra_embeddings.dropout = nn.Dropout()
    assert list(found(root)) == ["extra_embeddings"]


def test_no_bundle_when_the_parent_owns_parameters() -> None:
    root = bundle_model()
    root.extra_embeddings.scale = nn.Parameter(torch.ones(1))
    assert len(found(root)) == 2


def test_no_bundle_of_a_tower_and_a_projector() -> None:
    root = nn.Module()
    root.lm = nn.Linear(2, 2)
    root.model = nn.Module()
    root.model.vision_tower = nn.Linear(2, 2)
    root.model.multi_modal_projector = nn.Linear(2, 2)
    assert list(found(root)) == ["model.vision_tower", "model.multi_modal_projector"]


def test_no_bundle_around_a_single_tower() -> None:
    root = nn.Module()
    root.lm = nn.Linear(2, 2)
    root.wrapper = nn.Module()
    root.wrapper.vision_tower = nn.Linear(2, 2)
    assert list(found(root)) == ["wrapper.vision_tower"]


def test_the_root_is_never_a_bundle() -> None:
    root = nn.Module()
    root.vision_tower = nn.Linear(2, 2)
    root.audio_tower = nn.Linear(2, 2)
    assert list(found(root)) == ["vision_tower", "audio_tower"]


def test_no_bundle_when_a_member_is_excluded() -> None:
    items = resolve_multimodal_modules(bundle_model(), exclude=["extra_embeddings.audio_embed"])
    assert [i.path for i in items] == ["extra_embeddings.image_embed"]


# --- wrappers ------------------------------------------------------------------------------


def test_forward_is_read_through_an_activation_checkpoint_wrapper() -> None:
    """The wrapper's own forward takes ``*args``: the wrapped module's signature counts."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    root = Hub()
    root.encoder = checkpoint_wrapper(StackedPatchEncoder())
    items = resolve_multimodal_modules(root)
    assert [(i.path, i.rule) for i in items] == [("encoder", "forward:pixel_values")]
    assert items[0].module is root.encoder  # the registered wrapper, not its inner module


def test_wrapped_sequence_to_sequence_model_is_still_not_a_tower() -> None:
    """Its decoder inputs are only visible on the wrapped module's forward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    root = nn.Module()
    root.model = checkpoint_wrapper(Seq2Seq())
    assert found(root) == {}
