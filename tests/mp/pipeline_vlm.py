"""The tiny DeepSeek-V4.1 reference model cut into two pipeline stages, and its data.

Stage 0 runs the vision tower, the aligner, the embeddings and decoder layer 0; stage 1
decoder layer 1, the final norm and the head (``multimodal_fsdp.pipeline.split_stages``
makes the modules, the forwards below say what each computes). Torch's schedules cut a
batch into microbatches along dim 0 of every input, so stage 0 takes the images per
sample (``[samples, images_per_sample, C, H, W]``, zeros where a sample has fewer): a
sample's images stay with it, and a microbatch whose samples have none is text-only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional
from vlm import CONFIG, SEQ

from model_deepseek_v41 import make_batch
from model_deepseek_v41.modeling import Batch

#: Samples per microbatch and microbatches per step of each DP rank.
MB_SAMPLES = 2
MICROBATCHES = 2
#: Images per sample in each (DP rank, microbatch), per media layout: ``mixed`` has a
#: text-only microbatch on both ranks, at different places, and one with two images per
#: sample; in ``text_rank`` DP rank 1's whole step is text-only.
MEDIA = {"mixed": [[1, 0], [0, 2]], "text_rank": [[1, 0], [0, 0]]}
#: Images per sample the stage-0 input holds (zeros where a sample has fewer).
MAX_IMAGES = 2
STEPS = 2
LR = 0.05


def first_forward(stage: nn.Module, input_ids: Tensor, pixel_values: Tensor) -> Tensor:
    """Stage 0: the images of each sample that has them, encoded and spliced into the
    embeddings (no tower call for a text-only microbatch), then its decoder layers."""
    config = stage.config
    counts = (input_ids == config.image_token_id).sum(1) // config.image_tokens_per_image
    present = torch.arange(pixel_values.shape[1], device=counts.device) < counts[:, None]
    images = pixel_values[present]
    text = stage.model
    x = text.embed_tokens(input_ids)
    if images.shape[0]:
        features = stage.aligner(stage.vision(images))
        mask = (input_ids == config.image_token_id).unsqueeze(-1)
        x = x.masked_scatter(mask, features.reshape(-1, features.shape[-1]).to(x.dtype))
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    for layer in text.layers.values():
        x = layer(x, positions)
    return x


def last_forward(stage: nn.Module, hidden: Tensor) -> Tensor:
    """The last stage: its decoder layers, the final norm and the head (logits)."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    for layer in stage.model.layers.values():
        hidden = layer(hidden, positions)
    logits: Tensor = stage.lm_head(stage.model.norm(hidden))
    return logits


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    """The reference model's loss (next token, image positions ignored)."""
    vocab = logits.shape[-1]
    return functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def microbatches(step: int, dp_rank: int, media: str = "mixed") -> list[Batch]:
    """The microbatches of one DP rank in one step, as the model takes them."""
    return [
        make_batch(
            CONFIG,
            batch_size=MB_SAMPLES,
            seq_len=SEQ,
            num_images_per_sample=MEDIA[media][dp_rank][mb],
            seed=7000 + 31 * step + 7 * dp_rank + mb,
        )
        for mb in range(MICROBATCHES)
    ]


def stage_inputs(batches: list[Batch]) -> tuple[Tensor, Tensor, Tensor]:
    """One rank's step batch as the schedule takes it: ``input_ids``, the per-sample
    ``pixel_values`` (``MAX_IMAGES`` per sample) and the labels."""
    c, size = CONFIG.in_channels, CONFIG.image_size
    pixels = []
    for batch in batches:
        padded = torch.zeros(MB_SAMPLES, MAX_IMAGES, c, size, size)
        if batch["pixel_values"] is not None:
            per_sample = batch["pixel_values"].reshape(MB_SAMPLES, -1, c, size, size)
            padded[:, : per_sample.shape[1]] = per_sample
        pixels.append(padded)
    return (
        torch.cat([b["input_ids"] for b in batches]),
        torch.cat(pixels),
        torch.cat([b["labels"] for b in batches]),
    )
