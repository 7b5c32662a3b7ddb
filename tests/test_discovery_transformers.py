"""Discovery on real transformers model trees, built on the meta device (no weights, ~0.1 s each).

Each case pins the exact set of towers/projectors (with role and modality) found in the
``*ForConditionalGeneration`` (or equivalent top-level) class built from its default config.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from multimodal_fsdp.discovery.walk import (  # noqa: E402
    iter_multimodal_modules,
    resolve_multimodal_modules,
)

pytestmark = pytest.mark.transformers

ConfigFactory = Callable[[Any], Any]


@dataclass(frozen=True)
class Case:
    """One architecture: class, optional config factory, expected results, decoder layers."""

    cls_name: str
    expected: dict[str, str]  # path -> "role/modality"
    decoder_layers: tuple[str, ...]
    config: ConfigFactory | None = field(default=None)


def _aya_config(t: Any) -> Any:
    # The default SigLIP sub-config has 14 heads for width 1152, which does not divide.
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "num_attention_heads": 16,
        "intermediate_size": 4304,
        "num_hidden_layers": 2,
    }
    return t.AyaVisionConfig(vision_config=vision)


CASES: dict[str, Case] = {
    # --- LLaVA family and other "vision_tower + multi_modal_projector" models ---
    "llava": Case(
        "LlavaForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "llava_next": Case(
        "LlavaNextForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "llava_next_video": Case(
        "LlavaNextVideoForConditionalGeneration",
        {
            "model.vision_tower": "tower/vision",
            "model.multi_modal_projector": "projector/vision",
            "model.vision_resampler": "projector/vision",
        },
        ("model.language_model.layers",),
    ),
    "llava_onevision": Case(
        "LlavaOnevisionForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "vipllava": Case(
        "VipLlavaForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "video_llava": Case(
        "VideoLlavaForConditionalGeneration",
        {
            "model.video_tower": "tower/video",
            "model.image_tower": "tower/vision",
            # Shared by the image and the video tower, so no single modality.
            "model.multi_modal_projector": "projector/unknown",
        },
        ("model.language_model.layers",),
    ),
    "mistral3": Case(
        "Mistral3ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "aya_vision": Case(
        "AyaVisionForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
        _aya_config,
    ),
    "paligemma": Case(
        "PaliGemmaForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "gemma3": Case(
        "Gemma3ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "gemma4": Case(
        "Gemma4ForConditionalGeneration",
        {
            "model.vision_tower": "tower/vision",
            "model.audio_tower": "tower/audio",
            "model.embed_vision": "projector/vision",
            "model.embed_audio": "projector/audio",
        },
        ("model.language_model.layers",),
        # The default config is text only; add both modality sub-configs.
        lambda t: t.Gemma4Config(
            vision_config=t.Gemma4VisionConfig(), audio_config=t.Gemma4AudioConfig()
        ),
    ),
    "internvl": Case(
        "InternVLForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "aria": Case(
        "AriaForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "cohere2_vision": Case(
        "Cohere2VisionForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "got_ocr2": Case(
        "GotOcr2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "lfm2_vl": Case(
        "Lfm2VlForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "florence2": Case(
        "Florence2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.encoder.layers", "model.language_model.decoder.layers"),
    ),
    "kimi_k25": Case(
        "Kimi_K25ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.mm_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "molmo2": Case(
        "Molmo2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "granite4_vision": Case(
        "Granite4VisionForConditionalGeneration",
        {
            "model.vision_tower": "tower/vision",
            "model.layerwise_projectors": "projector/vision",
            "model.spatial_projectors": "projector/vision",
        },
        ("model.language_model.layers",),
        lambda t: t.Granite4VisionConfig(
            deepstack_layer_map=[[1, 2], [3, 4]], downsample_rate="4/8"
        ),
    ),
    # --- Qwen / GLM "visual" towers (patch merger lives inside the tower) ---
    "qwen2_vl": Case(
        "Qwen2VLForConditionalGeneration",
        {"model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "qwen2_5_vl": Case(
        "Qwen2_5_VLForConditionalGeneration",
        {"model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "qwen3_vl": Case(
        "Qwen3VLForConditionalGeneration",
        {"model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "qwen3_vl_moe": Case(
        "Qwen3VLMoeForConditionalGeneration",
        {"model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "qwen3_5_moe": Case(
        "Qwen3_5MoeForConditionalGeneration",
        {"model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "glm4v": Case(
        "Glm4vForConditionalGeneration",
        {"model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "glm4v_moe": Case(
        "Glm4vMoeForConditionalGeneration",
        {"model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "paddleocr_vl": Case(
        "PaddleOCRVLForConditionalGeneration",
        {"model.visual": "tower/vision", "model.projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "ernie4_5_vl_moe": Case(
        "Ernie4_5_VLMoeForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.resampler_model": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "minicpmv4_6": Case(
        "MiniCPMV4_6ForConditionalGeneration",
        # Here the merger is a sibling of the tower, hence a projector.
        {"model.vision_tower": "tower/vision", "model.merger": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "video_llama_3": Case(
        "VideoLlama3ForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    # --- Omni / audio-language models ---
    "qwen2_5_omni": Case(
        "Qwen2_5OmniForConditionalGeneration",
        {"thinker.model.audio_tower": "tower/audio", "thinker.model.visual": "tower/vision"},
        ("thinker.model.language_model.layers", "talker.model.layers"),
    ),
    "qwen2_5_omni_thinker": Case(
        "Qwen2_5OmniThinkerForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "qwen3_omni_moe_thinker": Case(
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.visual": "tower/vision"},
        ("model.language_model.layers",),
    ),
    "qwen2_audio": Case(
        "Qwen2AudioForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
        ("model.language_model.layers",),
    ),
    "voxtral": Case(
        "VoxtralForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
        ("model.language_model.layers",),
    ),
    "audioflamingo3": Case(
        "AudioFlamingo3ForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
        ("model.language_model.layers",),
    ),
    "glmasr": Case(
        "GlmAsrForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
        ("model.language_model.layers",),
    ),
    "vibevoice_asr": Case(
        "VibeVoiceAsrForConditionalGeneration",
        {
            "model.acoustic_tokenizer_encoder": "tower/audio",
            "model.semantic_tokenizer_encoder": "tower/audio",
            "model.multi_modal_projector": "projector/audio",
        },
        ("model.language_model.layers",),
    ),
    "granite_speech": Case(
        "GraniteSpeechForConditionalGeneration",
        # The speech encoder is registered as plain "encoder": found by its sub-config
        # (encoder_config of a speech type). The projector's name is modality-neutral and
        # no named tower stands beside it.
        {"model.encoder": "tower/audio", "model.projector": "projector/unknown"},
        ("model.language_model.layers",),
    ),
    "phi4_multimodal": Case(
        "Phi4MultimodalForCausalLM",
        # Both towers hang off one module beside the decoder's embedding, outside its layer
        # stack. That module holds nothing else, but it takes the token ids (every batch
        # runs it) and calls each tower only with its media: the towers are reported.
        {
            "model.embed_tokens_extend.image_embed": "tower/vision",
            "model.embed_tokens_extend.audio_embed": "tower/audio",
        },
        ("model.layers",),
    ),
    "seamless_m4t": Case(
        "SeamlessM4TForSpeechToText",
        {"speech_encoder": "tower/audio"},
        ("text_decoder.layers",),
    ),
    "kyutai_speech_to_text": Case(
        "KyutaiSpeechToTextForConditionalGeneration",
        {"codec_model": "tower/audio"},
        ("model.layers",),
    ),
    # --- Idefics / SmolVLM ("vision_model" + "connector", text model is "text_model") ---
    "idefics": Case(
        "IdeficsForVisionText2Text",
        {"model.vision_model": "tower/vision"},
        ("model.layers", "model.gated_cross_attn_layers"),
    ),
    "idefics2": Case(
        "Idefics2ForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.connector": "projector/vision"},
        ("model.text_model.layers",),
    ),
    "idefics3": Case(
        "Idefics3ForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.connector": "projector/vision"},
        ("model.text_model.layers",),
    ),
    "smolvlm": Case(
        "SmolVLMForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.connector": "projector/vision"},
        ("model.text_model.layers",),
    ),
    # --- Mllama / Llama 4 (cross-attention or un-nested layouts) ---
    "mllama": Case(
        "MllamaForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.multi_modal_projector": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "llama4": Case(
        "Llama4ForConditionalGeneration",
        {"vision_model": "tower/vision", "multi_modal_projector": "projector/vision"},
        ("language_model.model.layers",),
    ),
    # --- BLIP family (Q-Former bridge), Kosmos-2 ---
    "blip": Case(
        "BlipForConditionalGeneration",
        {"vision_model": "tower/vision"},
        ("text_decoder.bert.encoder.layer",),
    ),
    "blip_2": Case(
        "Blip2ForConditionalGeneration",
        {
            "vision_model": "tower/vision",
            "qformer": "projector/vision",
            "language_projection": "projector/vision",
        },
        ("language_model.model.decoder.layers",),
    ),
    "instructblip": Case(
        "InstructBlipForConditionalGeneration",
        {
            "vision_model": "tower/vision",
            "qformer": "projector/vision",
            "language_projection": "projector/vision",
        },
        ("language_model.model.decoder.layers",),
    ),
    "kosmos2": Case(
        "Kosmos2ForConditionalGeneration",
        {"vision_model": "tower/vision", "image_to_text_projection": "projector/vision"},
        ("text_model.model.layers",),
    ),
    # --- DeepSeek-VL / Janus ("aligner"), VQ image tokenizers ---
    "deepseek_vl": Case(
        "DeepseekVLForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.aligner": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "deepseek_vl_hybrid": Case(
        "DeepseekVLHybridForConditionalGeneration",
        {
            "model.high_res_vision_model": "tower/vision",
            "model.high_res_vision_neck": "tower/vision",
            "model.high_res_vision_proj": "projector/vision",
            "model.vision_model": "tower/vision",
            "model.aligner": "projector/vision",
        },
        ("model.language_model.layers",),
    ),
    "janus": Case(
        "JanusForConditionalGeneration",
        {
            "model.vision_model": "tower/vision",
            "model.aligner": "projector/vision",
            "model.vqmodel": "tower/vision",
            "model.generation_aligner": "projector/vision",
        },
        ("model.language_model.layers",),
    ),
    "chameleon": Case(
        "ChameleonForConditionalGeneration",
        {"model.vqmodel": "tower/vision"},
        ("model.layers",),
        lambda t: t.ChameleonConfig(vocabulary_map={"<image>": 8711}),
    ),
    "emu3": Case(
        "Emu3ForConditionalGeneration",
        {"model.vqmodel": "tower/vision"},
        ("model.text_model.layers",),
        lambda t: t.Emu3Config(vocabulary_map={"<image>": 1, "<|extra_200|>": 2}),
    ),
    # --- Other layouts ---
    "ovis2": Case(
        "Ovis2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.visual_embeddings_table": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "lighton_ocr": Case(
        "LightOnOcrForConditionalGeneration",
        {"model.vision_encoder": "tower/vision", "model.vision_projection": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "fuyu": Case(
        "FuyuForCausalLM",
        # No tower at all: patches are projected straight into the decoder.
        {"model.vision_embed_tokens": "projector/vision"},
        ("model.language_model.layers",),
    ),
    "t5gemma2": Case(
        "T5Gemma2ForConditionalGeneration",
        # Encoder-decoder: the vision tower is part of the (text+image) encoder.
        {
            "model.encoder.vision_tower": "tower/vision",
            "model.encoder.multi_modal_projector": "projector/vision",
        },
        ("model.encoder.text_model.layers", "model.decoder.layers"),
    ),
    "pi0": Case(
        "PI0ForConditionalGeneration",
        # A PaliGemma nested inside a robotics policy.
        {
            "model.vlm.vision_tower": "tower/vision",
            "model.vlm.multi_modal_projector": "projector/vision",
        },
        ("model.vlm.language_model.layers", "model.dit.layers"),
    ),
    # --- Default configs that do not build, repaired ---
    "hunyuan_vl": Case(
        "HunYuanVLForConditionalGeneration",
        {"model.vision_tower": "tower/vision"},
        ("model.language_model.layers",),
        # The default text config has no head_dim.
        lambda t: t.HunYuanVLConfig(text_config={"head_dim": 128}),
    ),
    "moonshine_streaming": Case(
        "MoonshineStreamingForConditionalGeneration",
        # The streaming speech encoder is a plain "encoder": found by its main input.
        {"model.encoder": "tower/audio"},
        ("model.decoder.layers",),
        # The default config has no num_key_value_heads.
        lambda t: t.MoonshineStreamingConfig(num_key_value_heads=8),
    ),
    # --- Negative controls ---
    "llama_text_only": Case("LlamaForCausalLM", {}, ("model.layers",)),
    "whisper": Case(
        "WhisperForConditionalGeneration",
        # Encoder-decoder ASR: the audio encoder is a plain "encoder", found because its
        # main input is input_features; the decoder is not a tower.
        {"model.encoder": "tower/audio"},
        ("model.decoder.layers",),
    ),
}

CASE_IDS = sorted(CASES)
STRUCTURAL_RULES = frozenset({"config", "main_input", "forward", "features", "bundle"})


def _construct(case_id: str) -> nn.Module:
    """Build the case's model on the meta device."""
    case = CASES[case_id]
    cls = getattr(transformers, case.cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {case.cls_name}")
    config = case.config(transformers) if case.config is not None else cls.config_class()
    with torch.device("meta"):
        model: nn.Module = cls._from_config(config)
    return model


# Built once per session and shared by the read-only tests; tests that modify a tree use
# _construct directly.
_build = functools.cache(_construct)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def test_enough_distinct_architectures_are_covered() -> None:
    positive = {case.cls_name for case in CASES.values() if case.expected}
    assert len(positive) >= 18


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_iter_finds_exactly_the_expected_modules(case_id: str) -> None:
    model = _build(case_id)
    found = [path for path, _ in iter_multimodal_modules(model)]
    assert len(found) == len(set(found)), found
    assert set(found) == set(CASES[case_id].expected)
    for path, module in iter_multimodal_modules(model):
        assert model.get_submodule(path) is module


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_resolver_roles_and_modalities(case_id: str) -> None:
    found = resolve_multimodal_modules(_build(case_id))
    got = {m.path: f"{m.role}/{m.modality}" for m in found}
    assert got == CASES[case_id].expected
    for m in found:
        name = m.path.rpartition(".")[2]
        # A name match reports its own name; a structural match says which rule fired.
        assert m.rule == f"name:{name}" or m.rule.partition(":")[0] in STRUCTURAL_RULES, m


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_name_only_discovery_is_what_structure_adds_to(case_id: str) -> None:
    """Structural rules only add modules (or bundle found ones): names keep their results."""
    model = _build(case_id)
    by_name = {m.path for m in resolve_multimodal_modules(model, structural=False)}
    full = {m.path for m in resolve_multimodal_modules(model)}
    for path in by_name - full:
        assert any(path.startswith(other + ".") for other in full), path


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_nothing_is_found_under_the_decoder_layers(case_id: str) -> None:
    model = _build(case_id)
    found = [m.path for m in resolve_multimodal_modules(model)]
    for layers in CASES[case_id].decoder_layers:
        stack = model.get_submodule(layers)  # the case must name a real layer stack
        assert isinstance(stack, nn.ModuleList)
        assert len(stack) > 0
        assert not [path for path in found if _under(path, layers)]
    # And, generally, nothing inside a numbered item of any layer container.
    assert not [path for path in found if any(part.isdecimal() for part in path.split("."))]


def test_planted_tower_names_in_mllama_text_decoder_are_ignored() -> None:
    """Mllama's cross-attention decoder layers are where a careless name match would fire."""
    model = _construct("mllama")
    text = model.get_submodule("model.language_model")
    layers = text.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)
    cross_layers = [layer for layer in layers if "CrossAttention" in type(layer).__name__]
    assert cross_layers, "expected Mllama cross-attention decoder layers"
    for layer in cross_layers:
        layer.get_submodule("cross_attn").vision_tower = nn.Linear(2, 2)
        layer.multi_modal_projector = nn.Linear(2, 2)
    text.visual = nn.Linear(2, 2)  # outside the layer stack, still inside the text model
    found = {path for path, _ in iter_multimodal_modules(model)}
    assert found == {"model.vision_model", "model.multi_modal_projector"}


def test_extra_encoder_name_finds_speech_encoders() -> None:
    """Without structural rules an extra name is the way to reach a plain "encoder"."""
    found = resolve_multimodal_modules(
        _build("granite_speech"), extra_tower_names=("encoder",), structural=False
    )
    assert [(m.path, m.role, m.rule) for m in found] == [
        ("model.encoder", "tower", "extra:encoder"),
        ("model.projector", "projector", "name:projector"),
    ]
    whisper = resolve_multimodal_modules(
        _build("whisper"), extra_tower_names=("encoder",), structural=False
    )
    assert [m.path for m in whisper] == ["model.encoder"]
    assert resolve_multimodal_modules(_build("whisper"), structural=False) == ()


def test_structural_rules_name_the_rule_that_matched() -> None:
    granite = {m.path: m.rule for m in resolve_multimodal_modules(_build("granite_speech"))}
    assert granite == {
        "model.encoder": "config:encoder_config",
        "model.projector": "name:projector",
    }
    whisper = resolve_multimodal_modules(_build("whisper"))
    assert [(m.path, m.rule) for m in whisper] == [("model.encoder", "main_input:input_features")]
    phi4 = resolve_multimodal_modules(_build("phi4_multimodal"))
    assert [(m.path, m.rule) for m in phi4] == [
        ("model.embed_tokens_extend.image_embed", "name:image_embed"),
        ("model.embed_tokens_extend.audio_embed", "name:audio_embed"),
    ]


def test_extra_encoder_name_does_not_reach_into_the_language_model() -> None:
    """Florence-2's language model is BART, whose own "encoder" must stay hidden."""
    model = _build("florence2")
    found = resolve_multimodal_modules(model, extra_tower_names=("encoder",))
    assert [m.path for m in found] == ["model.vision_tower", "model.multi_modal_projector"]
    assert isinstance(model.get_submodule("model.language_model.encoder"), nn.Module)


def test_exclude_on_a_real_model() -> None:
    model = _build("qwen2_5_omni")
    found = resolve_multimodal_modules(model, exclude=["thinker.model.audio_tower"])
    assert [m.path for m in found] == ["thinker.model.visual"]
    with pytest.raises(ValueError, match=r"\['thinker.model.audio'\]"):
        resolve_multimodal_modules(model, exclude=["thinker.model.audio"])
