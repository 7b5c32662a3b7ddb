"""Named model presets that other packages register, for the plan command line.

A lower layer must not import an upper one, so a model package registers a function
returning its [`ModelPreset`][multimodal_fsdp.cli.presets.ModelPreset] objects under the
entry-point group [`ENTRY_POINT_GROUP`][multimodal_fsdp.cli.presets.ENTRY_POINT_GROUP]::

    [project.entry-points."multimodal_fsdp.models"]
    my-model = "my_model_package.presets:model_presets"
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Final

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from multimodal_fsdp.parallelizer import MultimodalParallelizer

__all__ = ["ENTRY_POINT_GROUP", "ModelPreset", "model_presets"]

logger = logging.getLogger(__name__)

#: The entry-point group model packages register their presets under.
ENTRY_POINT_GROUP: Final[str] = "multimodal_fsdp.models"


@dataclass(frozen=True)
class ModelPreset:
    """A model the command line can plan by name.

    ``build(storage_dtype)`` returns the model on the ``meta`` device and its
    parallelizer. Optional: ``batch_loss(samples, tokens)`` returns one batch's loss
    (``plan --batch``); ``tp_plan(model, tp_size)`` the ``{path: ParallelStyle}`` plan of
    ``plan --tp`` (default
    [`llama_style_plan`][multimodal_fsdp.tensor_parallel.llama_style_plan]);
    ``ep_plan(model, ep_mesh)`` shards the routed experts and returns the parameter
    names it placed (``plan --ep``).
    """

    name: str
    description: str
    build: Callable[[torch.dtype], tuple[nn.Module, MultimodalParallelizer]]
    batch_loss: Callable[[int, int], Callable[[nn.Module], torch.Tensor]] | None = None
    tp_plan: Callable[[nn.Module, int], Mapping[str, ParallelStyle]] | None = None
    ep_plan: Callable[[nn.Module, DeviceMesh], Sequence[str]] | None = None


def model_presets() -> dict[str, ModelPreset]:
    """Every preset registered by an installed package, by name (one that fails to load
    is logged and left out: a broken plugin cannot break the command line).

    Returns:
        ``{name: preset}``.

    Raises:
        ValueError: two packages register a preset of the same name.
    """
    presets: dict[str, ModelPreset] = {}
    owners: dict[str, str] = {}
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            provided = _load(entry)
        except Exception as exc:  # a plugin's own bug must not stop the CLI
            logger.warning("skipping model presets %r (%s): %s", entry.name, entry.value, exc)
            continue
        for preset in provided:
            if preset.name in presets:
                raise ValueError(
                    f"model preset {preset.name!r} is registered twice: by {owners[preset.name]}"
                    f" and by {entry.value}"
                )
            presets[preset.name] = preset
            owners[preset.name] = entry.value
    return presets


def _load(entry: metadata.EntryPoint) -> list[ModelPreset]:
    factory = entry.load()
    if not callable(factory):
        raise TypeError(f"{entry.value} is not callable")
    provided = factory()
    if not isinstance(provided, Iterable):
        raise TypeError(f"{entry.value}() returned {type(provided).__name__}, not presets")
    items = list(provided)
    for item in items:
        if not isinstance(item, ModelPreset):
            raise TypeError(f"{entry.value}() returned a {type(item).__name__}, not a ModelPreset")
    return items
