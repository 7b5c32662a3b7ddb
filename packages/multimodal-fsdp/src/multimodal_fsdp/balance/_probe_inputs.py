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

from multimodal_fsdp.balance._arguments import named_parameters

__all__ = [
    "config_value",
    "floating_dtype",
    "candidate_rows",
    "first_layer",
    "mask_arguments",
    "mask_lengths",
]

#: Mel frames tried for an audio encoder that says nothing of its input length.
_AUDIO_FRAMES = 64
#: Mel frames tried next: a multiple of the subsampling factors and windows audio
#: encoders require of their padded input (8, 16, 32, 64, 100, 160, 200, 400).
_LONG_AUDIO_FRAMES = 1600
#: Samples tried for a raw-waveform encoder (a ``Conv1d`` of one input channel first):
#: 6 s at 16 kHz, a multiple of the usual hop lengths (160, 320, 400, 1920, 3200).
_WAVEFORM_SAMPLES = 96_000
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


_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def first_layer(tower: nn.Module) -> nn.Module | None:
    """The first module, in registration order, with parameters of its own; when that is
    not a linear or convolution layer (a norm, or the tower itself holding a learned
    embedding), the first one that is, which tells the shape of the input."""
    owners = [m for m in tower.modules() if any(True for _ in m.parameters(recurse=False))]
    if not owners:
        return None
    return next((m for m in owners if isinstance(m, _LAYERS)), owners[0])


def _pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int) and value > 0:
        return value, value
    if isinstance(value, (tuple, list)) and len(value) >= 2:
        return int(value[0]), int(value[1])
    return None


def candidate_rows(tower: nn.Module, main: str | None = None) -> list[tuple[int, ...]]:
    """Shapes of one row (item) of a batch-first tower's main input (named ``main``),
    most likely first."""
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
        rows += [(mel, _AUDIO_FRAMES), (mel, _LONG_AUDIO_FRAMES)]
    features = config_value(tower, "input_size", "input_dim")
    if isinstance(features, int):
        rows.append((_AUDIO_FRAMES, features))
    layer = first_layer(tower)
    if isinstance(layer, nn.Linear):
        rows += [(layer.in_features,), (4, layer.in_features)]
    elif isinstance(layer, nn.Conv1d):
        rows.append((layer.in_channels, _AUDIO_FRAMES))
        if layer.in_channels > 1:  # frames first, the encoder transposes them
            rows.append((_AUDIO_FRAMES, layer.in_channels))
    elif isinstance(layer, nn.Conv2d):
        sizes = [size] if size is not None else []
        sizes += [(s, s) for s in _IMAGE_SIZES]
        rows += [(layer.in_channels, *hw) for hw in sizes]
    elif isinstance(layer, nn.Conv3d):
        depth = int(layer.kernel_size[0])
        rows += [(layer.in_channels, depth, s, s) for s in _IMAGE_SIZES]
    waveform = main == "input_values" or (isinstance(layer, nn.Conv1d) and layer.in_channels == 1)
    if waveform:  # raw audio: samples per clip, with or without the channel axis
        rows += [(_WAVEFORM_SAMPLES,), (1, _WAVEFORM_SAMPLES)]
    return list(dict.fromkeys(rows))  # without repeats, most likely first


def mask_arguments(tower: nn.Module, main: str) -> list[str]:
    """The forward's mask arguments besides ``main`` (``attention_mask``,
    ``input_features_mask``, ``padding_mask``...): audio encoders read each clip's length
    from them, some even when they are optional."""
    return [name for name in named_parameters(tower) if name != main and name.endswith("mask")]


def mask_lengths(row: tuple[int, ...]) -> list[int]:
    """The lengths a per-row mask of an input row may have: its last axis (mel features
    by frames, raw samples), else its first (frames by features)."""
    return list(dict.fromkeys((row[-1], row[0])))
