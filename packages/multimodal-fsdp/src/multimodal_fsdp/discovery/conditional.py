"""Decoder layers that only run when the batch has media, found by structure.

Cross-attention VLMs (Mllama) interleave layers that read the image features and are
skipped on a text-only batch; as FSDP units they would make the ranks' collectives
diverge. The signal: in a layer container of mixed classes, a minority class that
requires a forward argument (``cross_attention_states``) the majority does not.
Stacks whose layers all take the same inputs (dense beside MoE) are not flagged.
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
        container = model.get_submodule(parent)
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
