"""balance_media=True where media-dependent modules own FSDP units, against one process.

Mllama's cross-attention decoder layers run only when the batch has images; Idefics2's
connector (a perceiver resampler with layers of its own) runs only on ranks with images.
Both are units: without balancing a text-only rank skips their collectives and the step
stops with ``UnevenMediaError``. With ``balance_media=True`` a rank that skips them joins
them on a placeholder (``multimodal_fsdp.runtime.joined_layers``, the exchange's rounds).
Each case runs four steps on 2 ranks: one rank text-only, even media, no media anywhere
(the joined modules' parameters keep no gradient), all media on the other rank, with an
eval pass before each step, compared with one process running every rank's batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from loops import LoopCase, _hf, _hf_batch, _hf_loss
from torch import nn

MLLAMA_STEPS: tuple[tuple[dict[str, int], ...], ...] = (
    ({"images": 2}, {"images": 0}),
    ({"images": 2}, {"images": 2}),
    ({"images": 0}, {"images": 0}),
    ({"images": 0}, {"images": 2}),
)
IDEFICS2_STEPS: tuple[tuple[dict[str, int], ...], ...] = (
    ({"images": 1}, {"images": 0}),
    ({"images": 2}, {"images": 1}),
    ({"images": 0}, {"images": 0}),
    ({"images": 0}, {"images": 2}),
)
IDEFICS2_IMAGE = 3
IDEFICS2_TOKENS = 4  # perceiver latents per image


def build_idefics2() -> nn.Module:
    import transformers as t

    config = t.Idefics2Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        perceiver_config={
            "hidden_size": 32,
            "resampler_n_latents": IDEFICS2_TOKENS,
            "resampler_depth": 2,
            "resampler_n_heads": 2,
            "resampler_head_dim": 8,
            "num_key_value_heads": 1,
        },
        text_config={
            "model_type": "mistral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": 140,
            "pad_token_id": 0,
        },
        image_token_id=IDEFICS2_IMAGE,
    )
    torch.manual_seed(0)
    model: nn.Module = t.Idefics2ForConditionalGeneration(config)
    return model


def idefics2_batch(seed: int, media: dict[str, int]) -> dict[str, Any]:
    """One sample with ``images`` images (4 tokens each)."""
    images = media.get("images", 0)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 140, (1, 20), generator=gen)
    ids[0, 1 : 1 + images * IDEFICS2_TOKENS] = IDEFICS2_IMAGE
    batch: dict[str, Any] = {
        "input_ids": ids,
        "labels": ids.masked_fill(ids == IDEFICS2_IMAGE, -100),
    }
    if images:
        batch["pixel_values"] = torch.randn(1, images, 3, 32, 32, generator=gen)
    return batch


def _idefics2(freeze_tower: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = build_idefics2()
        if freeze_tower:
            model.model.vision_model.requires_grad_(False)  # type: ignore[union-attr]
        return model

    return build


def _steps(table: tuple[tuple[dict[str, int], ...], ...]) -> Callable[[int, int], dict[str, int]]:
    return lambda step, rank: table[step][rank]


def _without_cache(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build`` with ``use_cache=False``: torch's ``checkpoint_wrapper`` (unlike
    transformers' own checkpointing) leaves the cache on, and the recomputation of a
    layer would read the keys its forward cached (in one process too)."""

    def make() -> nn.Module:
        model = build()
        model.config.use_cache = False
        model.config.get_text_config().use_cache = False
        return model

    return make


def _cases() -> list[LoopCase]:
    mllama: dict[str, Any] = {
        "batch": _hf_batch("mllama"),
        "loss": _hf_loss,
        "media": _steps(MLLAMA_STEPS),
        "steps": len(MLLAMA_STEPS),
        "balance_media": True,
        "optimizer": "adamw",
    }
    idefics2: dict[str, Any] = {
        "batch": idefics2_batch,
        "loss": _hf_loss,
        "media": _steps(IDEFICS2_STEPS),
        "steps": len(IDEFICS2_STEPS),
        "balance_media": True,
        "optimizer": "adamw",
    }
    return [
        LoopCase("mllama_root_frozen", _hf("mllama"), policy="root", loop="eval", **mllama),
        LoopCase("mllama_per_layer_frozen", _hf("mllama"), policy="per_layer", **mllama),
        # torch's checkpoint_wrapper around every decoder layer after sharding: a text-only
        # rank joins the cross-attention layers at the next layer's pre-hook, which must
        # run outside that layer's checkpointed region (issue 33).
        LoopCase(
            "mllama_per_layer_frozen_checkpoint_wrapper",
            _without_cache(_hf("mllama")),
            policy="per_layer",
            checkpointing="wrapper",
            checkpoint_after_sharding=True,
            **mllama,
        ),
        # SGD: AdamW turns the tiny gradients of this tower's first layers into full-size
        # steps, so rounding differences of the balanced batches (1e-7) grow past 1e-5.
        LoopCase(
            "mllama_per_layer_trainable",
            _hf("mllama", freeze_tower=False),
            policy="per_layer",
            **{**mllama, "optimizer": "sgd"},
        ),
        LoopCase("idefics2_root_frozen", _idefics2(True), policy="root", loop="eval", **idefics2),
        LoopCase("idefics2_per_layer_frozen", _idefics2(True), policy="per_layer", **idefics2),
        LoopCase("idefics2_per_layer_trainable", _idefics2(False), policy="per_layer", **idefics2),
        # Without balancing: the connector is a media region; the text-only rank's first
        # step stops on every rank with UnevenMediaError naming balance_media=True.
        LoopCase(
            "idefics2_root_unbalanced",
            _idefics2(True),
            policy="root",
            expect="uneven_error",
            **{**idefics2, "balance_media": False},
        ),
    ]


CASES: dict[str, LoopCase] = {case.name: case for case in _cases()}
