"""The vocabulary of discovery: tower and projector names, modalities, the result type.

The tables of known names and the keywords that give a caller-supplied name its modality
live here, so the list of model families reads in one place; the
[`walk`][multimodal_fsdp.discovery.walk] applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

__all__ = [
    "LANGUAGE_MODEL_NAMES",
    "MULTIMODAL_MODULE_NAMES",
    "MULTIMODAL_PROJECTOR_NAMES",
    "MULTIMODAL_TOWER_NAMES",
    "Modality",
    "MultimodalModule",
    "Role",
    "is_multimodal_module_name",
]

Role = Literal["tower", "projector"]
Modality = Literal["vision", "audio", "video", "unknown"]

# Tower name -> modality. The reference implementation's names come first, in its order
# (the exported tuples start with the reference's), model-specific names (with the family
# that uses them) after.
_TOWER_MODALITY: Mapping[str, Modality] = {
    # Generic vision towers: Qwen*-VL / GLM-4V / Omni thinkers ("visual"); LLaVA family,
    # Gemma 3/4, InternVL, PaliGemma, Mistral3 ("vision_tower"); Idefics*, SmolVLM, Mllama,
    # Llama 4, BLIP-2, Kosmos-2, DeepSeek-VL ("vision_model"); LightOnOCR ("vision_encoder");
    # GIT ("image_encoder"); "vit_model" is common outside transformers.
    "visual": "vision",
    "vision_tower": "vision",
    "vision_model": "vision",
    "vit_model": "vision",
    "image_encoder": "vision",
    "vision_encoder": "vision",
    # Generic audio towers: Qwen2-Audio, Voxtral, Gemma 4, Omni thinkers ("audio_tower").
    "audio_tower": "audio",
    "audio_encoder": "audio",
    "audio_model": "audio",
    # nemo-automodel 0.7.0 also lists "vision" (DeepSeek-V4.1 registers its tower so).
    "vision": "vision",
    # Video-LLaVA keeps separate image and video towers.
    "image_tower": "vision",
    "video_tower": "video",
    # SeamlessM4T speech-to-text.
    "speech_encoder": "audio",
    # DeepSeek-VL hybrid: SAM high-resolution encoder and its neck.
    "high_res_vision_model": "vision",
    "high_res_vision_neck": "vision",
    # Discrete image tokenizers (VQ-VAE): Chameleon, Emu3, Janus, GLM-Image, Apertus 1.5.
    "vqmodel": "vision",
    "vision_tokenizer": "vision",
    # Discrete / continuous audio tokenizers: Apertus 1.5, VibeVoice, Kyutai STT, CSM.
    "audio_tokenizer": "audio",
    "acoustic_tokenizer_encoder": "audio",
    "semantic_tokenizer_encoder": "audio",
    "codec_model": "audio",
    # Phi-4-multimodal: encoder + projection bundled under the text model's embedding.
    "image_embed": "vision",
    "audio_embed": "audio",
}

# Projector name -> modality ("unknown" = modality-neutral name; the resolver infers it
# from sibling towers, see ``_infer_projector_modality``).
_PROJECTOR_MODALITY: Mapping[str, Modality] = {
    # Gemma 3n / Gemma 4 embedders.
    "embed_vision": "vision",
    "embed_audio": "audio",
    # LLaVA-style names (most VLMs and audio LMs in transformers use the second one).
    "mm_projector": "unknown",
    "multi_modal_projector": "unknown",
    "multimodal_projector": "unknown",
    # Reference-table names: Step3 ("vit_large_projector"); the other two are common
    # outside transformers.
    "vision_projector": "vision",
    "vit_large_projector": "vision",
    "audio_projector": "audio",
    # DeepSeek-VL / Janus ("aligner"), Idefics2/3 and SmolVLM ("connector"), MiniCPM-V
    # ("merger" next to the tower; Qwen's merger lives inside the tower and stays hidden),
    # VideoLLaMA3 / PaddleOCR-VL / Granite Speech / Cosmos3 ("projector").
    "aligner": "unknown",
    "connector": "unknown",
    "merger": "unknown",
    "projector": "unknown",
    # BLIP-2 / InstructBLIP: Q-Former plus the linear map into the language model.
    "qformer": "unknown",
    "language_projection": "unknown",
    # Kosmos-2, LightOnOCR / Muse, Fuyu (patch projection straight into the decoder).
    "image_to_text_projection": "vision",
    "vision_projection": "vision",
    # GIT: image features into the text embedding space.
    "visual_projection": "vision",
    "vision_embed_tokens": "vision",
    # Muse adapters, LLaVA-NeXT-Video pooler, ERNIE-4.5-VL resampler.
    "vision_adapter": "vision",
    "vision_resampler": "vision",
    "resampler_model": "unknown",
    # Ovis2 visual embedding table, Janus generation aligner, DeepSeek-VL hybrid SAM proj.
    "visual_embeddings_table": "vision",
    "generation_aligner": "vision",
    "high_res_vision_proj": "vision",
    # VibeVoice semantic connector.
    "semantic_connector": "audio",
    # Granite 4 Vision deepstack / spatial projector stacks (ModuleLists of projectors).
    "layerwise_projectors": "vision",
    "spatial_projectors": "vision",
}

MULTIMODAL_TOWER_NAMES: tuple[str, ...] = tuple(_TOWER_MODALITY)
"""Attribute names under which models register modality encoders (towers)."""

MULTIMODAL_PROJECTOR_NAMES: tuple[str, ...] = tuple(_PROJECTOR_MODALITY)
"""Attribute names under which models register modality-to-text projectors."""

MULTIMODAL_MODULE_NAMES: tuple[str, ...] = MULTIMODAL_TOWER_NAMES + MULTIMODAL_PROJECTOR_NAMES
"""Towers first, then projectors."""

LANGUAGE_MODEL_NAMES: tuple[str, ...] = ("language_model", "text_model", "text_decoder", "llm")
"""Attribute names of text decoders; nothing strictly below them is a tower or projector
(a whole VLM registered under one of them is hidden: pass the inner model)."""

# Keyword -> modality, for names the user adds (built-in names use the tables above).
_MODALITY_KEYWORDS: tuple[tuple[str, Modality], ...] = (
    ("video", "video"),
    ("audio", "audio"),
    ("speech", "audio"),
    ("acoustic", "audio"),
    ("whisper", "audio"),
    ("wav", "audio"),
    ("vision", "vision"),
    ("visual", "vision"),
    ("image", "vision"),
    ("img", "vision"),
    ("vit", "vision"),
    ("pixel", "vision"),
)


# The subset that names an input modality in a sub-config attribute. "wav" is left out:
# it also names output vocoders (a ``token2wav`` speech generator is not a tower).
_INPUT_MODALITY_KEYWORDS: tuple[tuple[str, Modality], ...] = tuple(
    (keyword, modality)
    for keyword, modality in _MODALITY_KEYWORDS
    if keyword in ("video", "audio", "speech", "acoustic", "vision", "visual", "image")
)


@dataclass(frozen=True)
class MultimodalModule:
    """One discovered tower or projector.

    A modality-neutral projector takes the modality of the towers beside it ("unknown"
    when they disagree or there are none). ``rule`` records why it matched:
    ``"name:<attr>"``, ``"extra:<attr>"``, ``"config:<attr>"``, ``"main_input:<arg>"``,
    ``"forward:<arg>"``, ``"features:<arg>"`` or ``"bundle:<child>+<child>"``.
    """

    path: str
    module: nn.Module
    role: Role
    modality: Modality
    rule: str


@dataclass(frozen=True)
class _Rule:
    role: Role
    modality: Modality
    label: str


_BUILTIN_RULES: Mapping[str, _Rule] = {
    **{name: _Rule("tower", m, f"name:{name}") for name, m in _TOWER_MODALITY.items()},
    **{name: _Rule("projector", m, f"name:{name}") for name, m in _PROJECTOR_MODALITY.items()},
}


def is_multimodal_module_name(name: str) -> bool:
    """Whether the last component of a (possibly dotted) qualified name is a known name
    (the walk's structural guards are not applied).

    Args:
        name: a qualified module name.

    Returns:
        Whether its last component is a tower or projector name.

    Raises:
        TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}: {name!r}")
    return name.rpartition(".")[2] in _BUILTIN_RULES


def _modality_from_keywords(
    name: str, keywords: tuple[tuple[str, Modality], ...] = _MODALITY_KEYWORDS
) -> Modality:
    lowered = name.lower()
    return next((modality for keyword, modality in keywords if keyword in lowered), "unknown")
