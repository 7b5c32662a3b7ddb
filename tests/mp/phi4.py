"""Tiny Phi-4-multimodal (transformers ``Phi4MultimodalForCausalLM``) for the multi-process
tests: the model, its batches, and the loop cases of ``scenarios_phi4``.

Phi-4-multimodal keeps its encoders inside the decoder's embedding extension
(``model.embed_tokens_extend``, a ``Phi4MultimodalFeatureEmbedding``): every rank calls
that module with the token ids, and it calls its image encoder (``image_embed``) only
when the batch has images, its audio encoder (``audio_embed``) only when it has audio.
Under ``per_layer`` the encoders' layers are units, so a rank with images and a rank
without issue different all-gathers inside a module that every rank enters.
"""

from __future__ import annotations

from typing import Any

import torch
from loops import LoopCase, per_rank
from torch import nn

#: The module that holds both encoders (every rank calls it).
FEATURE_EMBEDDING = "model.embed_tokens_extend"
IMAGE_TOKEN = 5
AUDIO_TOKEN = 6
VOCAB = 131
IMAGE_SIZE = 32  # one crop: a global view and one sub-image per image
PATCH = 8
#: Image tokens per 32 x 32 image: 2 x 2 compressed patches, one separator column per
#: row, for the sub-image and the global view, and one separator between them.
IMAGE_TOKENS = 2 * (2 * (2 + 1)) + 1
#: How long a collective may wait in the scenario that must stop (the library's check
#: answers at once; a missing check shows as this timeout instead of a 10-minute hang).
SHORT_TIMEOUT_S = 20.0


def build_phi4() -> nn.Module:
    """Seeded fp32 model with 2 vision, 2 audio and 2 decoder layers; both encoders frozen."""
    import transformers

    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "crop_size": IMAGE_SIZE,
        "image_token_id": IMAGE_TOKEN,
    }
    audio = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_blocks": 2,
        "num_attention_heads": 2,
        "ext_pw_out_channel": 32,
        "depthwise_separable_out_channel": 32,
        "nemo_conv_channels": 32,
        "input_size": 16,
        "audio_token_id": AUDIO_TOKEN,
    }
    config = transformers.Phi4MultimodalConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        vision_config=vision,
        audio_config=audio,
    )
    torch.manual_seed(0)
    model: nn.Module = transformers.Phi4MultimodalForCausalLM(config)
    model.get_submodule(FEATURE_EMBEDDING).requires_grad_(False)
    return model


def phi4_batch(seed: int, media: dict[str, int]) -> dict[str, Any]:
    """2 samples of 40 tokens; ``media["images"]`` 32 x 32 images in all, their tokens
    in the leading positions (row-major, as the model fills them)."""
    images = media.get("images", 0)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, VOCAB, (2, 40), generator=gen)
    ids.view(-1)[: images * IMAGE_TOKENS] = IMAGE_TOKEN
    batch: dict[str, Any] = {
        "input_ids": ids,
        "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100),
    }
    if images:
        batch["image_pixel_values"] = torch.randn(
            images, 2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen
        )
        batch["image_sizes"] = torch.tensor([[IMAGE_SIZE, IMAGE_SIZE]] * images)
        side = IMAGE_SIZE // PATCH
        batch["image_attention_mask"] = torch.ones(images, 2, side, side, dtype=torch.bool)
    return batch


def phi4_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    loss: torch.Tensor = model(**batch).loss
    return loss


_COMMON: dict[str, Any] = {
    "build": build_phi4,
    "batch": phi4_batch,
    "loss": phi4_loss,
    "policy": "per_layer",
    "steps": 2,
}

CASES: dict[str, LoopCase] = {
    case.name: case
    for case in (
        # Images on rank 0 only: rank 1 enters the feature embedding but not its image
        # encoder, whose layers are units.
        LoopCase(
            "phi4_per_layer_images_on_rank0",
            media=per_rank({"images": 1}, {"images": 0}),
            expect="uneven_error",
            **_COMMON,
        ),
        # Images on every rank (a different number): every rank runs the image encoder once.
        LoopCase(
            "phi4_per_layer_images_on_every_rank",
            media=per_rank({"images": 1}, {"images": 2}),
            **_COMMON,
        ),
    )
}
