"""Tiny transformers vision- and audio-language models and their batches, for the
multi-process tests.

Each :class:`HfVlm` builds a seeded fp32 model on the CPU from a small config (well
under a second once transformers is imported) and makes deterministic batches with
any number of images (for Qwen2-VL also videos, for Qwen2-Audio audio clips). Tower
paths are the discovered ones, so tests can freeze them. The models cover different
tower layouts: a CLIP tower and an MLP projector (LLaVA), a SigLIP tower and a linear
projector (PaliGemma), a SigLIP-style tower and a pixel-shuffle connector (Idefics3), a
tower with its merger inside (Qwen2-VL), cross-attention decoder layers (Mllama), and an
audio tower (Qwen2-Audio).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Batch = dict[str, Any]


@dataclass(frozen=True)
class HfVlm:
    name: str
    tower: str
    build: Callable[[], nn.Module]
    batch: Callable[..., Batch]


def _transformers() -> Any:
    import transformers

    return transformers


# --- LLaVA: CLIP tower + MLP projector -------------------------------------------------------
LLAVA_IMAGE_TOKEN = 3
LLAVA_PATCHES = 16  # (32 / 8) ** 2 tokens per image


def build_llava(*, text_layers: int = 2) -> nn.Module:
    """A tiny LLaVA (2-layer CLIP tower, MLP projector, ``text_layers`` Llama layers)."""
    t = _transformers()
    vision = t.CLIPVisionConfig(
        hidden_size=36,
        intermediate_size=70,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=36,
    )
    text = t.LlamaConfig(
        hidden_size=36,
        intermediate_size=70,
        num_hidden_layers=text_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=131,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = t.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=LLAVA_IMAGE_TOKEN,
        projector_hidden_act="gelu",
    )
    torch.manual_seed(0)
    model: nn.Module = t.LlavaForConditionalGeneration(config)
    return model


def llava_batch(seed: int = 0, *, images: int = 1, seq: int = 40) -> Batch:
    """2 samples; ``images`` images in all, in the first sample's leading positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 131, (2, seq), generator=gen)
    flat = ids.view(-1)
    flat[: images * LLAVA_PATCHES] = LLAVA_IMAGE_TOKEN
    batch: Batch = {"input_ids": ids, "labels": ids.masked_fill(ids == LLAVA_IMAGE_TOKEN, -100)}
    if images:
        batch["pixel_values"] = torch.randn(images, 3, 32, 32, generator=gen)
    return batch


# --- Qwen2-VL: the merger inside the tower, one tower call per media kind ----------------------
QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END = 151, 152, 150, 153
QWEN_GRID = 4  # 4 x 4 patches, merged 2 x 2 -> 4 tokens per image or video frame
QWEN_PATCH_DIM = 3 * 2 * 4 * 4


def build_qwen2_vl() -> nn.Module:
    t = _transformers()
    config = t.Qwen2VLConfig(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 70,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": 163,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=QWEN_IMAGE,
        video_token_id=QWEN_VIDEO,
        vision_start_token_id=QWEN_START,
        vision_end_token_id=QWEN_END,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model: nn.Module = t.Qwen2VLForConditionalGeneration(config)
    return model


def qwen2_vl_batch(seed: int = 0, *, images: int = 1, videos: int = 0, seq: int = 48) -> Batch:
    """One sample with ``images`` images and ``videos`` one-frame videos (4 tokens each)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 140, (1, seq), generator=gen)
    position = 1
    for token, count in ((QWEN_IMAGE, images), (QWEN_VIDEO, videos)):
        for _ in range(count):
            ids[0, position] = QWEN_START
            ids[0, position + 1 : position + 5] = token
            ids[0, position + 5] = QWEN_END
            position += 6
    if position > seq:
        raise ValueError(f"{images} images and {videos} videos do not fit in {seq} tokens")
    grid = torch.tensor([[1, QWEN_GRID, QWEN_GRID]])
    batch: Batch = {
        "input_ids": ids,
        "labels": ids.clone(),
        "mm_token_type_ids": (ids == QWEN_IMAGE).int() + 2 * (ids == QWEN_VIDEO).int(),
    }
    if images:
        batch["pixel_values"] = torch.randn(images * QWEN_GRID**2, QWEN_PATCH_DIM, generator=gen)
        batch["image_grid_thw"] = grid.repeat(images, 1)
    if videos:
        batch["pixel_values_videos"] = torch.randn(
            videos * QWEN_GRID**2, QWEN_PATCH_DIM, generator=gen
        )
        batch["video_grid_thw"] = grid.repeat(videos, 1)
    return batch


# --- Mllama: cross-attention decoder layers that text-only batches skip ------------------------
MLLAMA_IMAGE = 5


def build_mllama() -> nn.Module:
    t = _transformers()
    config = t.MllamaConfig(
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_global_layers": 1,
            "attention_heads": 2,
            "image_size": 16,
            "patch_size": 8,
            "max_num_tiles": 1,
            "vision_output_dim": 32,
            "intermediate_layers_indices": [0],
            "supported_aspect_ratios": [[1, 1]],
        },
        text_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": 64,
            "cross_attention_layers": [1],
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        image_token_index=MLLAMA_IMAGE,
    )
    torch.manual_seed(0)
    model: nn.Module = t.MllamaForConditionalGeneration(config)
    with torch.no_grad():  # open the cross-attention gates (zero at init) so media matter
        for name, param in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                param.fill_(0.5)
    return model


def mllama_batch(seed: int = 0, *, images: int = 1, seq: int = 10) -> Batch:
    """2 samples; with ``images`` (0 or 2) one image tile per sample."""
    if images not in (0, 2):
        raise ValueError(f"mllama batches take 0 or 2 images (one per sample), got {images}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 64, (2, seq), generator=gen)
    batch: Batch = {"input_ids": ids, "labels": ids.clone()}
    if images:
        ids[:, 1] = MLLAMA_IMAGE
        batch["labels"] = ids.masked_fill(ids == MLLAMA_IMAGE, -100)
        batch["pixel_values"] = torch.randn(2, 1, 1, 3, 16, 16, generator=gen)
        batch["aspect_ratio_ids"] = torch.zeros(2, 1, dtype=torch.long)
        batch["aspect_ratio_mask"] = torch.ones(2, 1, 1, dtype=torch.long)
        batch["cross_attention_mask"] = torch.ones(2, seq, 1, 1, dtype=torch.long)
    return batch


# --- PaliGemma: SigLIP tower + linear projector, Gemma decoder --------------------------------
PALIGEMMA_IMAGE = 3
PALIGEMMA_PATCHES = 16  # (32 / 8) ** 2 tokens per image


def build_paligemma() -> nn.Module:
    t = _transformers()
    config = t.PaliGemmaConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
            "projection_dim": 32,
        },
        text_config={
            "model_type": "gemma",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "vocab_size": 140,
            "pad_token_id": 0,
        },
        image_token_index=PALIGEMMA_IMAGE,
        projection_dim=32,
        hidden_size=32,
    )
    torch.manual_seed(0)
    model: nn.Module = t.PaliGemmaForConditionalGeneration(config)
    return model


def paligemma_batch(seed: int = 0, *, images: int = 1, seq: int = 40) -> Batch:
    """2 samples; ``images`` images in all, in the leading positions (16 tokens each)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 140, (2, seq), generator=gen)
    ids.view(-1)[: images * PALIGEMMA_PATCHES] = PALIGEMMA_IMAGE
    batch: Batch = {
        "input_ids": ids,
        "labels": ids.masked_fill(ids == PALIGEMMA_IMAGE, -100),
        "token_type_ids": torch.zeros_like(ids),
    }
    if images:
        batch["pixel_values"] = torch.randn(images, 3, 32, 32, generator=gen)
    return batch


# --- Idefics3: vision transformer + pixel-shuffle connector, Llama decoder ---------------------
IDEFICS_IMAGE = 3
IDEFICS_TOKENS = 4  # 16 patches, pixel shuffle by 2 -> 4 tokens per image


def build_idefics3() -> nn.Module:
    t = _transformers()
    config = t.Idefics3Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        text_config={
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": 140,
            "pad_token_id": 0,
        },
        scale_factor=2,
        image_token_id=IDEFICS_IMAGE,
    )
    torch.manual_seed(0)
    model: nn.Module = t.Idefics3ForConditionalGeneration(config)
    return model


def idefics3_batch(seed: int = 0, *, images: int = 1, seq: int = 20) -> Batch:
    """One sample with ``images`` images (4 tokens each)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 140, (1, seq), generator=gen)
    ids[0, 1 : 1 + images * IDEFICS_TOKENS] = IDEFICS_IMAGE
    batch: Batch = {"input_ids": ids, "labels": ids.masked_fill(ids == IDEFICS_IMAGE, -100)}
    if images:
        batch["pixel_values"] = torch.randn(1, images, 3, 32, 32, generator=gen)
    return batch


# --- Qwen2-Audio: a Whisper-style audio tower + linear projector, Qwen2 decoder ----------------
AUDIO_TOKEN = 3
AUDIO_FRAMES = 40  # mel frames per clip -> 10 audio tokens (conv stride 2, pooling 2)
AUDIO_TOKENS = 10


#: A tiny Qwen2 decoder, the text model of the audio-language cases (vocabulary apart).
TINY_QWEN2_TEXT = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def build_qwen2_audio() -> nn.Module:
    t = _transformers()
    config = t.Qwen2AudioConfig(
        audio_config={
            "d_model": 32,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "num_mel_bins": 16,
            "max_source_positions": AUDIO_FRAMES // 2,
        },
        text_config={**TINY_QWEN2_TEXT, "vocab_size": 140},
        audio_token_index=AUDIO_TOKEN,
    )
    torch.manual_seed(0)
    model: nn.Module = t.Qwen2AudioForConditionalGeneration(config)
    return model


def qwen2_audio_batch(seed: int = 0, *, images: int = 1, seq: int = 28) -> Batch:
    """One sample with ``images`` audio clips (the loop cases count media as images)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 140, (1, seq), generator=gen)
    ids[0, 1 : 1 + images * AUDIO_TOKENS] = AUDIO_TOKEN
    batch: Batch = {"input_ids": ids, "labels": ids.masked_fill(ids == AUDIO_TOKEN, -100)}
    if images:
        batch["input_features"] = torch.randn(images, 16, AUDIO_FRAMES, generator=gen)
        batch["feature_attention_mask"] = torch.ones(images, AUDIO_FRAMES, dtype=torch.long)
    return batch


HF_VLMS: dict[str, HfVlm] = {
    "llava": HfVlm("llava", "model.vision_tower", build_llava, llava_batch),
    "qwen2_vl": HfVlm("qwen2_vl", "model.visual", build_qwen2_vl, qwen2_vl_batch),
    "mllama": HfVlm("mllama", "model.vision_model", build_mllama, mllama_batch),
    "paligemma": HfVlm("paligemma", "model.vision_tower", build_paligemma, paligemma_batch),
    "idefics3": HfVlm("idefics3", "model.vision_model", build_idefics3, idefics3_batch),
    "qwen2_audio": HfVlm("qwen2_audio", "model.audio_tower", build_qwen2_audio, qwen2_audio_batch),
}


def hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    loss: torch.Tensor = model(**batch).loss
    return loss
