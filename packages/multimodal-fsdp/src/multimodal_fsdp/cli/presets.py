"""Named model presets that other packages register, for the plan command line.

A lower layer must not import an upper one, so the command line cannot know which
model packages exist. A model package registers its presets under the entry-point
group [`ENTRY_POINT_GROUP`][multimodal_fsdp.cli.presets.ENTRY_POINT_GROUP] in its
``pyproject.toml``::

    [project.entry-points."multimodal_fsdp.models"]
    my-model = "my_model_package.presets:model_presets"

The entry point names a function that takes no argument and returns
[`ModelPreset`][multimodal_fsdp.cli.presets.ModelPreset] objects.
[`model_presets`][multimodal_fsdp.cli.presets.model_presets] collects them from every installed
package
(a third model package plugs in the same way as ``model-deepseek-v41``).
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

    ``build(storage_dtype)`` returns the model on the ``meta`` device (no memory, no
    weights) and the parallelizer that serves it. ``batch_loss(samples, tokens)``, when
    given, returns the loss of one batch of that shape, so the command line can trace
    a step's activations (``plan --batch``). ``tp_plan(model, tp_size)``, when given,
    returns the model's tensor-parallel plan (``{module path: ParallelStyle}``) that
    ``plan --tp`` applies; without it ``--tp`` uses
    [`llama_style_plan`][multimodal_fsdp.tensor_parallel.llama_style_plan].
    ``ep_plan(model, ep_mesh)``, when given, shards the model's routed experts over the
    1-D ``ep_mesh`` and returns the names of the parameters it placed (``plan --ep``).
    """

    name: str
    description: str
    build: Callable[[torch.dtype], tuple[nn.Module, MultimodalParallelizer]]
    batch_loss: Callable[[int, int], Callable[[nn.Module], torch.Tensor]] | None = None
    tp_plan: Callable[[nn.Module, int], Mapping[str, ParallelStyle]] | None = None
    ep_plan: Callable[[nn.Module, DeviceMesh], Sequence[str]] | None = None


def model_presets() -> dict[str, ModelPreset]:
    """Every preset registered by an installed package, by name.

    A registration that fails to load, or returns something other than presets, is
    logged and left out, so one broken plugin cannot break the command line; two
    presets of the same name are an error naming both packages.

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
