"""Decoder layers that only run when the batch has media, found by structure.

Cross-attention VLMs (Mllama and its kind) interleave layers that read the image
features into the decoder's layer stack and skip them on a text-only batch. When
such a layer is its own FSDP unit, a text-only rank beside an image rank issues
fewer all-gathers, and the ranks' collectives stop lining up (a crash on gloo, a
hang or wrong data on NCCL), whatever the frozen-tower policy.

The structural signal: a layer container holding items of more than one class,
where the items of a minority class require a forward argument that the majority
class does not require. A layer that cannot run without an input the ordinary
layers can do without (``cross_attention_states``, the media features) is the one
the decoder leaves out when that input is missing. Heterogeneous stacks whose
layers all take the same inputs (attention beside state-space layers, dense
beside MoE layers) are not flagged.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Iterator

from torch import nn

from fsdp_core.containers import (
    container_items,
    is_module_container,
    iter_layer_items,
    join_path,
    unwrap_module,
)
from fsdp_core.sharding import original_class

__all__ = ["find_media_conditional_layers", "required_forward_arguments"]

logger = logging.getLogger(__name__)


def required_forward_arguments(module: nn.Module) -> frozenset[str]:
    """Names of the forward parameters without a default (positional or keyword).

    Args:
        module: any module.

    Returns:
        The required argument names of its ``forward``.
    """
    try:
        signature = inspect.signature(original_class(module).forward)
    except (TypeError, ValueError):
        return frozenset()
    kinds = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    return frozenset(
        name
        for name, param in signature.parameters.items()
        if name != "self" and param.kind in kinds and param.default is inspect.Parameter.empty
    )


def _containers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every layer container whose items become units (same walk as the units)."""
    seen: set[int] = set()
    for path, _item in iter_layer_items(model):
        parent = path.rpartition(".")[0]
        container = model.get_submodule(parent) if parent else model
        if id(container) not in seen and is_module_container(container):
            seen.add(id(container))
            yield parent, container


def find_media_conditional_layers(model: nn.Module) -> list[str]:
    """Paths of layer-container items that the decoder runs only with media (see above).

    Args:
        model: the model.

    Returns:
        The items' qualified names.
    """
    found: list[str] = []
    for prefix, container in _containers(model):
        items = [
            (join_path(prefix, key), unwrap_module(item))
            for key, item in container_items(container)
        ]
        classes = Counter(original_class(item) for _, item in items)
        if len(classes) < 2:
            continue
        majority = max(classes, key=lambda cls: classes[cls])
        majority_required = required_forward_arguments(
            next(item for _, item in items if original_class(item) is majority)
        )
        for path, item in items:
            if original_class(item) is majority:
                continue
            extra = required_forward_arguments(item) - majority_required
            if extra:
                logger.debug("%s runs only with %s: media-dependent", path, sorted(extra))
                found.append(path)
    return found
