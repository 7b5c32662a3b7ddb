"""balance_media=True on the tower families of issue 26, as loop cases compared with one
process running the whole global batch (``scenarios_balance_families``,
``tests/test_balance_media_families.py``).

Tiny transformers models built from their configs, one per layout the plan-time probe
picks:

- ``mistral3`` (``Mistral3ForConditionalGeneration``) and ``llava_pixtral`` (LLaVA with a
  Pixtral tower): ``packed-by-size``, images of different sizes in one padded batch;
- ``qwen2_audio`` (``Qwen2AudioForConditionalGeneration``): ``batch-first`` on
  ``input_features``;
- ``audioflamingo3`` (``AudioFlamingo3ForConditionalGeneration``): ``batch-first`` on
  ``input_features`` with the ``input_features_mask`` its encoder requires (clips of
  different valid lengths);
- ``omni`` (``Qwen2_5OmniThinkerForConditionalGeneration``): ``packed-by-length`` for
  clips of different lengths beside the ``packed-by-grid`` vision tower;
- ``phi4`` (``Phi4MultimodalForCausalLM``): the encoders inside the feature embedding
  (``image_embed.img_processor``, ``audio_embed.encoder``), both ``batch-first``;
- ``mllama`` (``MllamaForConditionalGeneration``): ``tiled``, samples with different
  numbers of images of up to two tiles.

Each model runs under ``root`` and ``per_layer`` with its tower frozen and with a
trainable tower, three steps whose media distribution changes: a 3:1 skew, all media on
one rank, all on the other (Mllama keeps media on both ranks here: its text-only rank,
whose cross-attention layers join on a placeholder, is ``balanced_joined``'s case;
Qwen2.5-Omni and Phi-4 mix their two kinds of media unevenly). ``CROSS_TOWER``: audio
on one rank and images on the other.
``mistral3_counted``: every batch also passes ``num_items_in_batch`` (a 0-d tensor that
differs between ranks), which Mistral 3 hands down to the tower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from loops import LoopCase, Media
from torch import nn

Batch = dict[str, Any]
#: Per step, each rank's media (2 ranks).
Steps = tuple[tuple[dict[str, int], ...], ...]


def _transformers() -> Any:
    import transformers

    return transformers


def _steps(per_step: Steps) -> Media:
    return lambda step, rank: per_step[step][rank]


def _freeze(model: nn.Module, paths: tuple[str, ...], frozen: bool) -> nn.Module:
    if frozen:
        for path in paths:
            model.get_submodule(path).requires_grad_(False)
    return model


def _image_tokens(ids: torch.Tensor, token: int, counts: list[int], start: int = 1) -> None:
    """Put ``sum(counts)`` image tokens in the first sample from ``start`` on."""
    total = sum(counts)
    if start + total > ids.shape[1]:
        raise ValueError(f"{total} media tokens do not fit in {ids.shape[1]} tokens")
    ids[0, start : start + total] = token


# ----------------------------------------------------------------- Pixtral towers
PIXTRAL_VISION = {
    "model_type": "pixtral",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
    "head_dim": 16,
}
MISTRAL_TEXT = {
    "model_type": "mistral",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 131,
    "head_dim": 16,
}
IMAGE_TOKEN = 3
#: Image sizes in turn (height, width): every batch mixes sizes.
MISTRAL_SIZES = ((32, 32), (16, 32), (32, 16))  # 4, 2, 2 tokens (patch 8, merge 2)
LLAVA_SIZES = ((16, 16), (16, 24), (24, 16))  # 4, 6, 6 tokens (patch 8)


def build_mistral3(*, frozen: bool = True) -> nn.Module:
    t = _transformers()
    config = t.Mistral3Config(
        vision_config=PIXTRAL_VISION,
        text_config=MISTRAL_TEXT,
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    return _freeze(t.Mistral3ForConditionalGeneration(config), ("model.vision_tower",), frozen)


def build_llava_pixtral(*, frozen: bool = True) -> nn.Module:
    t = _transformers()
    config = t.LlavaConfig(
        vision_config=PIXTRAL_VISION,
        text_config=MISTRAL_TEXT,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    torch.manual_seed(0)
    return _freeze(t.LlavaForConditionalGeneration(config), ("model.vision_tower",), frozen)


def _pixtral_batch(
    seed: int, media: dict[str, int], sizes: tuple[tuple[int, int], ...], per_token: int
) -> Batch:
    """2 samples of 40 tokens; ``media["images"]`` images of the sizes in turn, padded to
    the largest, ``image_sizes`` each one's size."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 131, (2, 40), generator=gen)
    count = media.get("images", 0)
    chosen = [sizes[(seed + i) % len(sizes)] for i in range(count)]
    _image_tokens(ids, IMAGE_TOKEN, [h * w // per_token for h, w in chosen])
    batch: Batch = {"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100)}
    if count:
        tall, wide = max(h for h, _ in chosen), max(w for _, w in chosen)
        pixels = torch.zeros(count, 3, tall, wide)
        for i, (h, w) in enumerate(chosen):
            pixels[i, :, :h, :w] = torch.randn(3, h, w, generator=gen)
        batch["pixel_values"] = pixels
        batch["image_sizes"] = torch.tensor(chosen)
    return batch


def mistral3_batch(seed: int, media: dict[str, int]) -> Batch:
    return _pixtral_batch(seed, media, MISTRAL_SIZES, 16 * 16)


def mistral3_counted_batch(seed: int, media: dict[str, int]) -> Batch:
    """``mistral3_batch`` with ``num_items_in_batch``, a 0-d tensor as transformers'
    ``Trainer`` passes it (here this rank's label count: it differs between ranks);
    Mistral 3 hands it down to the tower through ``**kwargs``."""
    batch = mistral3_batch(seed, media)
    batch["num_items_in_batch"] = batch["labels"].ne(-100).sum()
    return batch


def llava_pixtral_batch(seed: int, media: dict[str, int]) -> Batch:
    return _pixtral_batch(seed, media, LLAVA_SIZES, 8 * 8)


# ------------------------------------------------------------------ Qwen2-Audio
def build_qwen2_audio(*, frozen: bool = True) -> nn.Module:
    from hf_vlms import build_qwen2_audio as build

    return _freeze(build(), ("model.audio_tower",), frozen)


def qwen2_audio_batch(seed: int, media: dict[str, int]) -> Batch:
    from hf_vlms import qwen2_audio_batch as make

    return make(seed, images=media.get("audio", 0), seq=40)


# --------------------------------------------------------------- AudioFlamingo3
#: The Whisper-style audio encoder of AudioFlamingo3 and Qwen2.5-Omni, tiny.
TINY_AUDIO_ENCODER = {
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
}
AF3_AUDIO = 150
AF3_MEL = 16
AF3_FRAMES = 32  # every clip padded to 2 * max_source_positions frames
AF3_LENGTHS = (32, 20, 26)  # valid frames in turn: 8, 5 and 6 audio tokens


def build_audioflamingo3(*, frozen: bool = True) -> nn.Module:
    from hf_vlms import TINY_QWEN2_TEXT

    t = _transformers()
    config = t.AudioFlamingo3Config(
        audio_config={
            **TINY_AUDIO_ENCODER,
            "num_mel_bins": AF3_MEL,
            "max_source_positions": AF3_FRAMES // 2,
        },
        text_config={**TINY_QWEN2_TEXT, "vocab_size": 200},
        audio_token_id=AF3_AUDIO,
    )
    torch.manual_seed(0)
    model = t.AudioFlamingo3ForConditionalGeneration(config)
    return _freeze(model, ("model.audio_tower",), frozen)


def audioflamingo3_batch(seed: int, media: dict[str, int]) -> Batch:
    """One sample of 40 tokens; ``media["audio"]`` clips padded to 32 frames whose
    ``input_features_mask`` marks the valid frames (the lengths in turn), so that the
    encoder reads each clip's length from its mask row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 140, (1, 40), generator=gen)
    lengths = [AF3_LENGTHS[(seed + i) % len(AF3_LENGTHS)] for i in range(media.get("audio", 0))]
    _image_tokens(ids, AF3_AUDIO, [_clip_tokens(n) for n in lengths])
    batch: Batch = {"input_ids": ids, "labels": ids.masked_fill(ids == AF3_AUDIO, -100)}
    if lengths:
        features = torch.zeros(len(lengths), AF3_MEL, AF3_FRAMES)
        mask = torch.zeros(len(lengths), AF3_FRAMES, dtype=torch.long)
        for i, frames in enumerate(lengths):
            features[i, :, :frames] = torch.randn(AF3_MEL, frames, generator=gen)
            mask[i, :frames] = 1
        batch["input_features"] = features
        batch["input_features_mask"] = mask
    return batch


# ----------------------------------------------------------------- Qwen2.5-Omni
OMNI_AUDIO, OMNI_IMAGE, OMNI_VIDEO = 160, 161, 162
OMNI_AUDIO_START, OMNI_AUDIO_END, OMNI_VISION_START, OMNI_VISION_END = 163, 164, 165, 166
OMNI_CLIPS = (40, 24, 32)  # mel frames in turn: 10, 6 and 8 audio tokens
OMNI_MEL = 16


def build_omni(*, frozen: bool = True) -> nn.Module:
    t = _transformers()
    config = t.Qwen2_5OmniThinkerConfig(
        audio_config={
            **TINY_AUDIO_ENCODER,
            "num_mel_bins": OMNI_MEL,
            "max_source_positions": 100,
            "n_window": 10,
            "output_dim": 32,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 16,
            "out_hidden_size": 32,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
        },
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": 200,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 2, 4],
            },
        },
        audio_token_index=OMNI_AUDIO,
        image_token_index=OMNI_IMAGE,
        video_token_index=OMNI_VIDEO,
        audio_start_token_id=OMNI_AUDIO_START,
        audio_end_token_id=OMNI_AUDIO_END,
        vision_start_token_id=OMNI_VISION_START,
        vision_end_token_id=OMNI_VISION_END,
    )
    torch.manual_seed(0)
    model = t.Qwen2_5OmniThinkerForConditionalGeneration(config)
    return _freeze(model, ("model.audio_tower", "model.visual"), frozen)


def _clip_tokens(frames: int) -> int:
    """Audio tokens of a clip of ``frames`` valid frames (a stride-2 convolution, then
    a stride-2 pooling), in Qwen2.5-Omni and AudioFlamingo3."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def omni_batch(seed: int, media: dict[str, int]) -> Batch:
    """One sample of 64 tokens: ``media["audio"]`` clips of the lengths in turn (padded
    to the longest, ``feature_attention_mask`` saying each one's frames), then
    ``media["images"]`` images of 4 x 4 patches (4 tokens), each between its start and
    end tokens, and the ``mm_token_type_ids`` a processor gives."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 150, (1, 64), generator=gen)
    clips = [OMNI_CLIPS[(seed + i) % len(OMNI_CLIPS)] for i in range(media.get("audio", 0))]
    images = media.get("images", 0)
    position = 1
    segments = [(OMNI_AUDIO_START, OMNI_AUDIO, _clip_tokens(n), OMNI_AUDIO_END) for n in clips]
    segments += [(OMNI_VISION_START, OMNI_IMAGE, 4, OMNI_VISION_END)] * images
    for start, token, count, end in segments:
        ids[0, position] = start
        ids[0, position + 1 : position + 1 + count] = token
        ids[0, position + 1 + count] = end
        position += count + 2
    if position > ids.shape[1]:
        raise ValueError(f"media {media} do not fit in {ids.shape[1]} tokens")
    labels = ids.masked_fill((ids == OMNI_AUDIO) | (ids == OMNI_IMAGE), -100)
    # The token types the Qwen processors return; the thinker names no such argument, so
    # it forwards them to both towers in its **kwargs (they read none of it).
    types = (ids == OMNI_IMAGE).int() + 3 * (ids == OMNI_AUDIO).int()
    batch: Batch = {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": types,
    }
    if clips:
        longest = max(clips)
        features = torch.zeros(len(clips), OMNI_MEL, longest)
        mask = torch.zeros(len(clips), longest, dtype=torch.long)
        for i, frames in enumerate(clips):
            features[i, :, :frames] = torch.randn(OMNI_MEL, frames, generator=gen)
            mask[i, :frames] = 1
        batch["input_features"] = features
        batch["feature_attention_mask"] = mask
    if images:
        batch["pixel_values"] = torch.randn(images * 16, 3 * 2 * 4 * 4, generator=gen)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * images)
    return batch


# ---------------------------------------------------------------------- Phi-4
PHI4_AUDIO_FRAMES = 64  # 8 audio tokens per clip (time reduction 8)


def build_phi4(*, frozen: bool = True) -> nn.Module:
    from phi4 import FEATURE_EMBEDDING
    from phi4 import build_phi4 as build

    model = build()  # both encoders frozen
    if not frozen:
        model.get_submodule(FEATURE_EMBEDDING).requires_grad_(True)
    return model


def phi4_batch(seed: int, media: dict[str, int]) -> Batch:
    """``phi4.phi4_batch``'s images, and ``media["audio"]`` clips of 64 frames after
    them (8 tokens each)."""
    from phi4 import AUDIO_TOKEN, IMAGE_TOKENS
    from phi4 import phi4_batch as images_batch

    batch = images_batch(seed, {"images": media.get("images", 0)})
    clips = media.get("audio", 0)
    if clips:
        ids = batch["input_ids"]
        start = media.get("images", 0) * IMAGE_TOKENS
        flat = ids.view(-1)
        tokens = PHI4_AUDIO_FRAMES // 8
        flat[start : start + clips * tokens] = AUDIO_TOKEN
        batch["labels"] = batch["labels"].masked_fill(ids == AUDIO_TOKEN, -100)
        gen = torch.Generator().manual_seed(seed + 1)
        batch["audio_input_features"] = torch.randn(clips, PHI4_AUDIO_FRAMES, 16, generator=gen)
        batch["audio_embed_sizes"] = torch.tensor([tokens] * clips)
    return batch


# ---------------------------------------------------------------------- Mllama
MLLAMA_IMAGE = 5
MLLAMA_TILES = 2


def build_mllama(*, frozen: bool = True) -> nn.Module:
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
            "max_num_tiles": MLLAMA_TILES,
            "vision_output_dim": 32,
            "intermediate_layers_indices": [0],
            "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
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
    model = t.MllamaForConditionalGeneration(config)
    with torch.no_grad():  # open the cross-attention gates (zero at init) so media matter
        for name, param in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                param.fill_(0.5)
    return _freeze(model, ("model.vision_model",), frozen)


def mllama_batch(seed: int, media: dict[str, int]) -> Batch:
    """2 samples of 10 tokens; ``media["images"]`` images over them (the first sample
    takes the extra one), each of 1 or 2 tiles in turn; samples pad to the most images
    of the batch (pixels 0, ``aspect_ratio_mask`` 0), and each sample's image tokens
    attend to its own images' tiles."""
    images = media.get("images", 0)
    if images < 1:
        raise ValueError("the mllama cases keep media on every rank")
    per_sample = [(images + 1) // 2, images // 2]
    most = max(per_sample)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 64, (2, 10), generator=gen)
    pixels = torch.zeros(2, most, MLLAMA_TILES, 3, 16, 16)
    ratio_ids = torch.zeros(2, most, dtype=torch.long)
    ratio_mask = torch.zeros(2, most, MLLAMA_TILES, dtype=torch.long)
    cross = torch.zeros(2, 10, most, MLLAMA_TILES, dtype=torch.long)
    k = 0
    for s, count in enumerate(per_sample):
        for i in range(count):
            tiles = 1 + (seed + k) % 2
            k += 1
            pixels[s, i, :tiles] = torch.randn(tiles, 3, 16, 16, generator=gen)
            ratio_ids[s, i] = 1 if tiles == 1 else 2  # [1, 1] or [1, 2]
            ratio_mask[s, i, :tiles] = 1
            ids[s, 1 + i] = MLLAMA_IMAGE
            cross[s, 1 + i :, i, :tiles] = 1
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(ids == MLLAMA_IMAGE, -100),
        "pixel_values": pixels,
        "aspect_ratio_ids": ratio_ids,
        "aspect_ratio_mask": ratio_mask,
        "cross_attention_mask": cross,
    }


# ------------------------------------------------------------------------ cases
def hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    loss: torch.Tensor = model(**batch).loss
    return loss


IMAGES: Steps = (
    ({"images": 3}, {"images": 1}),  # 3:1 skew
    ({"images": 2}, {"images": 0}),  # all media on rank 0
    ({"images": 0}, {"images": 3}),  # all on rank 1
)
AUDIO: Steps = (
    ({"audio": 3}, {"audio": 1}),
    ({"audio": 2}, {"audio": 0}),
    ({"audio": 0}, {"audio": 3}),
)
OMNI: Steps = (
    ({"audio": 2, "images": 1}, {"audio": 1, "images": 3}),  # both kinds, uneven
    ({"audio": 3}, {"audio": 1}),  # 3:1
    ({"audio": 2}, {}),  # all media on rank 0
)
PHI4: Steps = (
    ({"images": 1, "audio": 1}, {"images": 2, "audio": 2}),  # both kinds, uneven
    ({"images": 3}, {"images": 1}),  # 3:1
    ({"images": 2}, {}),  # all media on rank 0
)
#: Each rank calls a different tower first: audio on one rank and images on the other,
#: then every medium on one rank: the exchange's rounds pair calls of different towers
#: (see ``CROSS_TOWER``).
OMNI_CROSS: Steps = (
    ({"audio": 2}, {"images": 2}),
    ({}, {"audio": 2, "images": 2}),
)
PHI4_CROSS: Steps = (
    ({"images": 1}, {"audio": 2}),
    ({"images": 1, "audio": 1}, {}),
)
MLLAMA: Steps = (
    ({"images": 3}, {"images": 1}),
    ({"images": 1}, {"images": 3}),
    ({"images": 2}, {"images": 4}),
)

#: Per model: its builder, batch, steps.
MODELS: dict[
    str, tuple[Callable[..., nn.Module], Callable[[int, dict[str, int]], Batch], Steps]
] = {
    "mistral3": (build_mistral3, mistral3_batch, IMAGES),
    "llava_pixtral": (build_llava_pixtral, llava_pixtral_batch, IMAGES),
    "qwen2_audio": (build_qwen2_audio, qwen2_audio_batch, AUDIO),
    "audioflamingo3": (build_audioflamingo3, audioflamingo3_batch, AUDIO),
    "omni": (build_omni, omni_batch, OMNI),
    "phi4": (build_phi4, phi4_batch, PHI4),
    "mllama": (build_mllama, mllama_batch, MLLAMA),
}
#: Per model: the balanced module paths and their layouts the plan-time probe chose.
LAYOUTS: dict[str, dict[str, str]] = {
    "mistral3": {"model.vision_tower": "packed-by-size"},
    "llava_pixtral": {"model.vision_tower": "packed-by-size"},
    "qwen2_audio": {"model.audio_tower": "batch-first"},
    "audioflamingo3": {"model.audio_tower": "batch-first"},
    "omni": {"model.audio_tower": "packed-by-length", "model.visual": "packed-by-grid"},
    "phi4": {
        "model.embed_tokens_extend.image_embed.img_processor": "batch-first",
        "model.embed_tokens_extend.audio_embed.encoder": "batch-first",
    },
    "mllama": {"model.vision_model": "tiled"},
}
#: (policy, tower) per case: a frozen tower under root and per_layer, a trainable one.
COMBOS: tuple[tuple[str, str], ...] = (
    ("root", "frozen"),
    ("per_layer", "frozen"),
    ("root", "trainable"),
)


def _builder(build: Callable[..., nn.Module], frozen: bool) -> Callable[[], nn.Module]:
    return lambda: build(frozen=frozen)


def _case(model: str, policy: str, tower: str, steps: Steps, suffix: str = "") -> LoopCase:
    build, batch, _ = MODELS[model]
    return LoopCase(
        f"{model}{suffix}_{policy}_{tower}",
        _builder(build, tower == "frozen"),
        media=_steps(steps),
        policy=policy,
        balance_media=True,
        steps=len(steps),
        batch=batch,
        loss=hf_loss,
    )


def _cases() -> list[LoopCase]:
    cases = [
        _case(model, policy, tower, steps)
        for model, (_, _, steps) in MODELS.items()
        for policy, tower in COMBOS
    ]
    cases += [
        # A pass-through 0-d tensor argument of the tower, different on each rank.
        dataclasses.replace(
            _case("mistral3", "per_layer", "trainable", IMAGES, "_counted"),
            batch=mistral3_counted_batch,
        ),
        _case("omni", "root", "frozen", OMNI_CROSS, "_cross"),
        _case("phi4", "root", "frozen", PHI4_CROSS, "_cross"),
    ]
    return cases


#: The cases whose ranks call different towers in the same round (audio here, images
#: there): a round carries a call of any balanced tower, runs the lowest one called,
#: and the other rank brings its call again in the next round.
CROSS_TOWER = frozenset({"omni_cross_root_frozen", "phi4_cross_root_frozen"})


CASES: dict[str, LoopCase] = {case.name: case for case in _cases()}
