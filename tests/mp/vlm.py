"""The small VLM of the multi-process tests (the tiny DeepSeek-V4.1 reference model)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model_deepseek_v41 import DeepseekV41Config, build_deepseek_v41, make_batch
from model_deepseek_v41.modeling import Batch

CONFIG = DeepseekV41Config.tiny()
SEQ = 16
LR = 0.05


def build_vlm(*, dtype: torch.dtype, frozen_tower: bool, device: str = "cpu") -> nn.Module:
    model = build_deepseek_v41(CONFIG, seed=0, dtype=dtype, device=device)
    if frozen_tower:
        model.vision.requires_grad_(False)
    return model


def vlm_batches(
    steps: int, world: int, *, images: list[int] | None = None, base_seed: int = 1000
) -> list[list[Batch]]:
    """``batches[step][rank]``; ``images[rank]`` images per sample (default 1 everywhere)."""
    per_rank = images or [1] * world
    return [
        [
            make_batch(
                CONFIG,
                batch_size=2,
                seq_len=SEQ,
                num_images_per_sample=per_rank[rank],
                seed=base_seed + 97 * step + rank,
            )
            for rank in range(world)
        ]
        for step in range(steps)
    ]


def to_device(batch: Batch, device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def vlm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    loss: torch.Tensor = model(**batch)
    return loss


def is_vision_norm(name: str) -> bool:
    return name.startswith("vision.") and name.split(".")[-2] in ("norm1", "norm2", "norm")


def global_batches(
    steps: int, *, per_step: int = 8, images: int = 1, base_seed: int = 5000
) -> list[Batch]:
    """One global batch per step, to be split evenly over any number of ranks."""
    return [
        make_batch(
            CONFIG,
            batch_size=per_step,
            seq_len=SEQ,
            num_images_per_sample=images,
            seed=base_seed + step,
        )
        for step in range(steps)
    ]


def split_batch(batch: Batch, world: int, rank: int) -> Batch:
    """Rank ``rank``'s equal share of a global batch (samples and their images)."""
    samples = batch["input_ids"].shape[0]
    if samples % world:
        raise ValueError(f"{samples} samples do not split over {world} ranks")
    per = samples // world
    rows = slice(rank * per, (rank + 1) * per)
    pixels = batch["pixel_values"]
    if pixels is not None:
        per_sample = pixels.shape[0] // samples
        pixels = pixels[rank * per * per_sample : (rank + 1) * per * per_sample]
    return Batch(
        input_ids=batch["input_ids"][rows], pixel_values=pixels, labels=batch["labels"][rows]
    )
