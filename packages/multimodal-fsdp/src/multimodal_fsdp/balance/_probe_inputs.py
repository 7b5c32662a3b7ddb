"""What a tower's inputs look like, for the plan-time probe's tiny calls.

A layout builds its probe calls from facts about the tower: its transformers config
(``image_size``, ``num_channels``, ``patch_size``, ``num_mel_bins``...) or, for a plain
custom tower, its first layer (a ``Linear`` takes rows of ``in_features``, a ``Conv2d``
images of ``in_channels``). Candidates are only guesses: the probe keeps the first one
the tower runs on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["config_value", "floating_dtype", "candidate_rows", "first_layer"]

#: Mel frames tried for an audio encoder that says nothing of its input length.
_AUDIO_FRAMES = 64
#: Spatial sizes tried for a convolution whose input size nothing gives.
_IMAGE_SIZES = (32, 224)


def config_value(tower: nn.Module, *names: str) -> Any:
    """The first of ``names`` the tower's ``config`` (or the tower itself) has, else None."""
    for owner in (getattr(tower, "config", None), tower):
        if owner is None:
            continue
        for name in names:
            value = getattr(owner, name, None)
            if value is not None and not isinstance(value, nn.Module):
                return value
    return None


def floating_dtype(tower: nn.Module) -> torch.dtype:
    """The dtype of the tower's first floating parameter (float32 without one)."""
    for param in tower.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def first_layer(tower: nn.Module) -> nn.Module | None:
    """The first module, in registration order, with parameters of its own."""
    for module in tower.modules():
        if any(True for _ in module.parameters(recurse=False)):
            return module
    return None


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int) and value > 0:
        return value, value
    if isinstance(value, (tuple, list)) and len(value) >= 2:
        return int(value[0]), int(value[1])
    return None


def candidate_rows(tower: nn.Module) -> list[tuple[int, ...]]:
    """Shapes of one row (item) of a batch-first tower's main input, most likely first."""
    rows: list[tuple[int, ...]] = []
    channels = int(config_value(tower, "num_channels", "in_channels", "in_chans") or 3)
    size = _pair(config_value(tower, "image_size", "img_size"))
    if size is not None:
        rows.append((channels, *size))
    mel = config_value(tower, "num_mel_bins", "n_mels")
    if isinstance(mel, int):
        positions = config_value(tower, "max_source_positions")
        if isinstance(positions, int):
            rows += [(mel, 2 * positions), (mel, positions)]
        rows.append((mel, _AUDIO_FRAMES))
    features = config_value(tower, "input_size", "input_dim")
    if isinstance(features, int):
        rows.append((_AUDIO_FRAMES, features))
    layer = first_layer(tower)
    if isinstance(layer, nn.Linear):
        rows += [(layer.in_features,), (4, layer.in_features)]
    elif isinstance(layer, nn.Conv1d):
        rows.append((layer.in_channels, _AUDIO_FRAMES))
    elif isinstance(layer, nn.Conv2d):
        sizes = [size] if size is not None else []
        sizes += [(s, s) for s in _IMAGE_SIZES]
        rows += [(layer.in_channels, *hw) for hw in sizes]
    elif isinstance(layer, nn.Conv3d):
        depth = int(layer.kernel_size[0])
        rows += [(layer.in_channels, depth, s, s) for s in _IMAGE_SIZES]
    unique: list[tuple[int, ...]] = []
    for row in rows:
        if row not in unique:
            unique.append(row)
    return unique
