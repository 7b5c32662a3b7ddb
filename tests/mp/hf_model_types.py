"""Every vision- and audio-language model type of transformers 5.24, with the towers and
projectors discovery must find in each (labelled by hand from the model trees), and how
to build one from its default config on the meta device.

Shared by ``tests/test_discovery_every_type.py`` (exact-set discovery) and
``tests/test_balance_media_every_type.py`` (balance_media planned on each).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch import nn
from transformers.models.auto import modeling_auto

PINNED_VERSION = "5.24."
MAPPINGS = (
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_VISUAL_QUESTION_ANSWERING_MAPPING_NAMES",
)
# Multimodal types that transformers registers only under text mappings.
EXTRA_TYPES = ("audioflamingo3", "musicflamingo", "modernvbert", "ultravbert")

EXPECTED: dict[str, tuple[str, dict[str, str]]] = {
    "apertus1p5": (
        "Apertus1p5ForConditionalGeneration",
        {"model.vision_tokenizer": "tower/vision", "model.audio_tokenizer": "tower/audio"},
    ),
    "aria": (
        "AriaForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "audioflamingo3": (
        "AudioFlamingo3ForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "blip": ("BlipForConditionalGeneration", {"vision_model": "tower/vision"}),
    "blip-2": (
        "Blip2ForConditionalGeneration",
        {
            "vision_model": "tower/vision",
            "qformer": "projector/vision",
            "language_projection": "projector/vision",
        },
    ),
    "canary": ("CanaryForConditionalGeneration", {"model.encoder": "tower/audio"}),
    "cohere2_vision": (
        "Cohere2VisionForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "cohere_asr": ("CohereAsrForConditionalGeneration", {"model.encoder": "tower/audio"}),
    "cosmos3_edge": (
        "Cosmos3EdgeForConditionalGeneration",
        {"model.visual": "tower/vision", "model.projector": "projector/vision"},
    ),
    "cosmos3_omni": ("Cosmos3OmniForConditionalGeneration", {"model.visual": "tower/vision"}),
    "deepseek_vl": (
        "DeepseekVLForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.aligner": "projector/vision"},
    ),
    "deepseek_vl_hybrid": (
        "DeepseekVLHybridForConditionalGeneration",
        {
            "model.high_res_vision_model": "tower/vision",
            "model.high_res_vision_neck": "tower/vision",
            "model.high_res_vision_proj": "projector/vision",
            "model.vision_model": "tower/vision",
            "model.aligner": "projector/vision",
        },
    ),
    # Text-to-speech: its encoder reads text, so nothing is a tower.
    "dia": ("DiaForConditionalGeneration", {}),
    "dots3_note": (
        "Dots3NoteForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.audio_tower": "tower/audio"},
    ),
    "ernie4_5_vl_moe": (
        "Ernie4_5_VLMoeForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.resampler_model": "projector/vision"},
    ),
    # Protein-text: the protein encoder is not a vision/audio/video modality.
    "evolla": ("EvollaForProteinText2Text", {}),
    "exaone4_5": ("Exaone4_5_ForConditionalGeneration", {"model.visual": "tower/vision"}),
    "florence2": (
        "Florence2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "fun_asr_nano": (
        "FunAsrNanoForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "fuyu": ("FuyuForCausalLM", {"model.vision_embed_tokens": "projector/vision"}),
    "gemma3": (
        "Gemma3ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    # The default configs are text only (no vision or audio sub-config).
    "gemma4": ("Gemma4ForConditionalGeneration", {}),
    "gemma4_unified": ("Gemma4UnifiedForConditionalGeneration", {}),
    "git": (
        "GitForCausalLM",
        {"git.image_encoder": "tower/vision", "git.visual_projection": "projector/vision"},
    ),
    "glm46v": ("Glm46VForConditionalGeneration", {"model.visual": "tower/vision"}),
    "glm4v": ("Glm4vForConditionalGeneration", {"model.visual": "tower/vision"}),
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration", {"model.visual": "tower/vision"}),
    "glm5_next": ("Glm5NextForConditionalGeneration", {"model.visual": "tower/vision"}),
    "glm_ocr": ("GlmOcrForConditionalGeneration", {"model.visual": "tower/vision"}),
    "glmasr": (
        "GlmAsrForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "glmga": ("Glm46VForConditionalGeneration", {"model.visual": "tower/vision"}),
    "got_ocr2": (
        "GotOcr2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "granite_docling": (
        "GraniteDoclingForConditionalGeneration",
        {"model.vision_model": "tower/vision"},
    ),
    # Plain "encoder": found by its encoder_config of a speech type.
    "granite_speech": (
        "GraniteSpeechForConditionalGeneration",
        {"model.encoder": "tower/audio", "model.projector": "projector/unknown"},
    ),
    "granite_speech_plus": (
        "GraniteSpeechPlusForConditionalGeneration",
        {"model.encoder": "tower/audio", "model.projector": "projector/unknown"},
    ),
    "hy_v4_vl": ("HYV4VLForConditionalGeneration", {"model.vision_tower": "tower/vision"}),
    "hyperclovax_vision_v2": (
        "HyperCLOVAXVisionV2ForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.projector": "projector/vision"},
    ),
    "idefics": ("IdeficsForVisionText2Text", {"model.vision_model": "tower/vision"}),
    "idefics2": (
        "Idefics2ForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.connector": "projector/vision"},
    ),
    "idefics3": (
        "Idefics3ForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.connector": "projector/vision"},
    ),
    "inkling2": ("Inkling2ForConditionalGeneration", {"model.vision_tower": "tower/vision"}),
    "inkling2_loop": (
        "Inkling2LoopForConditionalGeneration",
        {"model.vision_tower": "tower/vision"},
    ),
    "inkling_mm_model": (
        "InklingForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.vision_tower": "tower/vision"},
    ),
    "instructblip": (
        "InstructBlipForConditionalGeneration",
        {
            "vision_model": "tower/vision",
            "qformer": "projector/vision",
            "language_projection": "projector/vision",
        },
    ),
    "instructblipvideo": (
        "InstructBlipVideoForConditionalGeneration",
        {
            "vision_model": "tower/vision",
            "qformer": "projector/vision",
            "language_projection": "projector/vision",
        },
    ),
    "internvl": (
        "InternVLForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "janus": (
        "JanusForConditionalGeneration",
        {
            "model.vision_model": "tower/vision",
            "model.aligner": "projector/vision",
            "model.vqmodel": "tower/vision",
            "model.generation_aligner": "projector/vision",
        },
    ),
    "kimi_k25": (
        "Kimi_K25ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.mm_projector": "projector/vision"},
    ),
    "kosmos-2": (
        "Kosmos2ForConditionalGeneration",
        {"vision_model": "tower/vision", "image_to_text_projection": "projector/vision"},
    ),
    "kosmos-2.5": (
        "Kosmos2_5ForConditionalGeneration",
        {"vision_model": "tower/vision", "image_to_text_projection": "projector/vision"},
    ),
    "kyutai_speech_to_text": (
        "KyutaiSpeechToTextForConditionalGeneration",
        {"codec_model": "tower/audio"},
    ),
    "lfm2_vl": (
        "Lfm2VlForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "lfm3_vl": (
        "Lfm3VlForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "lighton_ocr": (
        "LightOnOcrForConditionalGeneration",
        {"model.vision_encoder": "tower/vision", "model.vision_projection": "projector/vision"},
    ),
    "llama4": (
        "Llama4ForConditionalGeneration",
        {"vision_model": "tower/vision", "multi_modal_projector": "projector/vision"},
    ),
    "llava": (
        "LlavaForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "llava_next": (
        "LlavaNextForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "llava_next_video": (
        "LlavaNextVideoForConditionalGeneration",
        {
            "model.vision_tower": "tower/vision",
            "model.multi_modal_projector": "projector/vision",
            "model.vision_resampler": "projector/vision",
        },
    ),
    "llava_onevision": (
        "LlavaOnevisionForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "minicpm_ocr": (
        "MiniCPMOcrForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.merger": "projector/vision"},
    ),
    "minicpmv4_6": (
        "MiniCPMV4_6ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.merger": "projector/vision"},
    ),
    "minicpmv4_7": (
        "MiniCPMV4_7ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.merger": "projector/vision"},
    ),
    "minimax_m3_vl": (
        "MiniMaxM3SparseForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "mistral3": (
        "Mistral3ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    # Registered as multimodal, but the default model is the text decoder alone.
    "mistral4": ("Mistral4ForCausalLM", {}),
    "mistral_large4": (
        "MistralLarge4ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "mllama": (
        "MllamaForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "modernvbert": (
        "ModernVBertForMaskedLM",
        {"model.vision_model": "tower/vision", "model.connector": "projector/vision"},
    ),
    "molmo2": (
        "Molmo2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "moonshine": ("MoonshineForConditionalGeneration", {"model.encoder": "tower/audio"}),
    "moss_transcribe_diarize": (
        "MossTranscribeDiarizeForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "muse_glimmer": (
        "MuseGlimmerForConditionalGeneration",
        {
            "model.vision_tower": "tower/vision",
            "model.vision_adapter": "projector/vision",
            "model.vision_projection": "projector/vision",
        },
    ),
    "muse_spark": (
        "MuseSparkForConditionalGeneration",
        {
            "model.vision_tower": "tower/vision",
            "model.vision_adapter": "projector/vision",
            "model.vision_projection": "projector/vision",
            "model.audio_tower": "tower/audio",
        },
    ),
    "musicflamingo": (
        "MusicFlamingoForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "nemo_speechlm": (
        "Nemotron3_5TranscribeForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "nemotron_h_omni": (
        "NemotronH_Omni_Reasoning_V3",
        {"vision_model": "tower/vision", "multi_modal_projector": "projector/vision"},
    ),
    "omniasr": (
        "OmniASRForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "ovis2": (
        "Ovis2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.visual_embeddings_table": "projector/vision"},
    ),
    "paddleocr_vl": (
        "PaddleOCRVLForConditionalGeneration",
        {"model.visual": "tower/vision", "model.projector": "projector/vision"},
    ),
    "paligemma": (
        "PaliGemmaForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    # Both encoders under the decoder's embedding extension, which every batch runs (it
    # takes the token ids) and which calls each encoder only with its media: two towers.
    "phi4_multimodal": (
        "Phi4MultimodalForCausalLM",
        {
            "model.embed_tokens_extend.image_embed": "tower/vision",
            "model.embed_tokens_extend.audio_embed": "tower/audio",
        },
    ),
    "pi0": (
        "PI0ForConditionalGeneration",
        {
            "model.vlm.vision_tower": "tower/vision",
            "model.vlm.multi_modal_projector": "projector/vision",
        },
    ),
    # The image encoder is plain "encoder": found by its vision_config.
    "pix2struct": ("Pix2StructForConditionalGeneration", {"encoder": "tower/vision"}),
    # Spectrogram frames enter a text-style encoder as inputs_embeds: no tower.
    "pop2piano": ("Pop2PianoForConditionalGeneration", {}),
    "pp_chart2table": (
        "GotOcr2ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    # Plain "encoder" with its projector inside: the encoder is the maximal tower.
    "pp_formulanet": ("PPFormulaNetForConditionalGeneration", {"model.encoder": "tower/vision"}),
    "qianfan_ocr": (
        "QianfanOCRForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "qwen2_5_omni": (
        "Qwen2_5OmniForConditionalGeneration",
        {"thinker.model.audio_tower": "tower/audio", "thinker.model.visual": "tower/vision"},
    ),
    "qwen2_5_omni_thinker": (
        "Qwen2_5OmniThinkerForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.visual": "tower/vision"},
    ),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", {"model.visual": "tower/vision"}),
    "qwen2_audio": (
        "Qwen2AudioForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", {"model.visual": "tower/vision"}),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", {"model.visual": "tower/vision"}),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", {"model.visual": "tower/vision"}),
    "qwen3_asr": (
        "Qwen3ASRForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "qwen3_omni_moe_thinker": (
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.visual": "tower/vision"},
    ),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", {"model.visual": "tower/vision"}),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", {"model.visual": "tower/vision"}),
    "seamless_m4t": ("SeamlessM4TForSpeechToText", {"speech_encoder": "tower/audio"}),
    "seamless_m4t_v2": ("SeamlessM4Tv2ForSpeechToText", {"speech_encoder": "tower/audio"}),
    "shieldgemma2": (
        "Gemma3ForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "smolvlm": (
        "SmolVLMForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.connector": "projector/vision"},
    ),
    "speech-encoder-decoder": ("SpeechEncoderDecoderModel", {"encoder": "tower/audio"}),
    "speech_to_text": ("Speech2TextForConditionalGeneration", {"model.encoder": "tower/audio"}),
    # Speech prenet + encoder under a non-"model" prefix: found by main_input_name.
    "speecht5": ("SpeechT5ForSpeechToText", {"speecht5.encoder": "tower/audio"}),
    "step3p7": (
        "Step3p7ForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "t5gemma2": (
        "T5Gemma2ForConditionalGeneration",
        {
            "model.encoder.vision_tower": "tower/vision",
            "model.encoder.multi_modal_projector": "projector/vision",
        },
    ),
    # Single-stream: image patches are embedded by the text encoder itself (the root's
    # patch_embed is tied to it), so there is no separate tower.
    "udop": ("UdopForConditionalGeneration", {}),
    "ultravbert": (
        "UltraVBertForMaskedLM",
        {"model.vision_model": "tower/vision", "model.connector": "projector/vision"},
    ),
    "unlimited_ocr": (
        "UnlimitedOcrForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    "vibevoice": (
        "VibeVoiceForConditionalGeneration",
        {
            "model.audio_tower": "tower/audio",
            "model.multi_modal_projector": "projector/audio",
            "model.semantic_tokenizer_encoder": "tower/audio",
            "model.semantic_connector": "projector/audio",
        },
    ),
    "vibevoice_asr": (
        "VibeVoiceAsrForConditionalGeneration",
        {
            "model.acoustic_tokenizer_encoder": "tower/audio",
            "model.semantic_tokenizer_encoder": "tower/audio",
            "model.multi_modal_projector": "projector/audio",
        },
    ),
    "video_llama_3": (
        "VideoLlama3ForConditionalGeneration",
        {"model.vision_model": "tower/vision", "model.projector": "projector/vision"},
    ),
    "video_llava": (
        "VideoLlavaForConditionalGeneration",
        {
            "model.video_tower": "tower/video",
            "model.image_tower": "tower/vision",
            "model.multi_modal_projector": "projector/unknown",
        },
    ),
    # Single-stream: the patch embedding is part of the text model's embedding layer.
    "vilt": ("ViltForQuestionAnswering", {}),
    "vipllava": (
        "VipLlavaForConditionalGeneration",
        {"model.vision_tower": "tower/vision", "model.multi_modal_projector": "projector/vision"},
    ),
    # Plain "encoder": found by its encoder config of a vision type (ViT).
    "vision-encoder-decoder": ("VisionEncoderDecoderModel", {"encoder": "tower/vision"}),
    "voxtral": (
        "VoxtralForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    "voxtral_realtime": (
        "VoxtralRealtimeForConditionalGeneration",
        {"model.audio_tower": "tower/audio", "model.multi_modal_projector": "projector/audio"},
    ),
    # Speech-to-text encoder-decoders: the encoder is found by main_input_name.
    "whisper": ("WhisperForConditionalGeneration", {"model.encoder": "tower/audio"}),
}

UNBUILDABLE: dict[str, str] = {
    "aya_vision": "default SigLIP sub-config: 14 heads do not divide width 1152",
    "chameleon": "needs a vocabulary_map (tested with one in test_discovery_transformers.py)",
    "cohere_compass": "KeyError: 'full_attention' while building from the default config",
    "deepseek_ocr2": "TypeError: 'NoneType' object is not subscriptable (a default left unset)",
    "diffusion_gemma": "TypeError: a parameter size is None in the default config",
    "emu3": "needs a vocabulary_map (tested with one in test_discovery_transformers.py)",
    "fast_vlm": "its TimmWrapper vision tower needs timm and Pillow (not installed)",
    "gemma3n": "its TimmWrapper vision tower needs timm and Pillow (not installed)",
    "granite4_vision": "needs deepstack_layer_map and downsample_rate (tested with them)",
    "hunyuan_vl": "TypeError: None ** float (the default text config has no head_dim)",
    "moonshine_streaming": "AttributeError: the default config has no num_key_value_heads",
    "perception_lm": "its TimmWrapper vision tower needs timm and Pillow (not installed)",
    "qwen3_omni_moe": "talker config lacks shared_expert_intermediate_size (thinker tested)",
    "qwen4_exp": "TypeError: None // None (a default size left unset)",
}


def pinned() -> bool:
    return str(transformers.__version__).startswith(PINNED_VERSION)


def universe() -> set[str]:
    types: set[str] = set(EXTRA_TYPES)
    for name in MAPPINGS:
        types.update(getattr(modeling_auto, name, {}))
    return types


def build(cls_name: str) -> nn.Module:
    cls = getattr(transformers, cls_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model: nn.Module = cls._from_config(cls.config_class())
    return model


def build_or_skip(model_type: str) -> nn.Module:
    cls_name = EXPECTED[model_type][0]
    if getattr(transformers, cls_name, None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    try:
        return build(cls_name)
    except Exception as error:  # only off the pinned version: there every type builds
        if pinned():
            raise
        pytest.skip(f"{cls_name} does not build here: {type(error).__name__}: {error}")
