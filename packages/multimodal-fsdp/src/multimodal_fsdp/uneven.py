"""Fail fast, instead of hanging, when ranks disagree on whether a batch has media.

When a tower or projector owns FSDP units (``per_layer`` for a frozen tower, or
a trainable tower's layers), only ranks whose batch holds images/audio run
them, so their all-gathers no longer line up with the other ranks' and the
job hangs or dies deep in the collective library. Before each forward of the
root, :func:`install_uneven_media_guard` agrees on "has media" across ranks
with one 2-element all-reduce, and raises the same ``RuntimeError`` on every
rank when they differ, naming the modules and the policies that allow it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DEFAULT_MEDIA_INPUTS",
    "UnevenMediaError",
    "batch_has_media",
    "install_uneven_media_guard",
]

logger = logging.getLogger(__name__)

#: Forward arguments that carry images, video or audio in common VLM/ALM signatures.
DEFAULT_MEDIA_INPUTS: Final[tuple[str, ...]] = (
    "pixel_values",
    "pixel_values_videos",
    "images",
    "image",
    "videos",
    "input_features",
    "input_values",
    "audio_values",
    "input_audio_embeds",
    "image_embeds",
    "audio_input_features",
)

_GUARD_ATTR = "_multimodal_fsdp_uneven_media_guard"


class UnevenMediaError(RuntimeError):
    """Some ranks have media in this batch and others do not, under a plan that forbids it."""


def _present(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    if isinstance(value, (list, tuple, dict)):
        return len(value) > 0 and any(
            _present(v) for v in (value.values() if isinstance(value, dict) else value)
        )
    return True


def batch_has_media(
    forward: Any, args: Sequence[Any], kwargs: dict[str, Any], media_inputs: Iterable[str]
) -> bool | None:
    """Whether a call carries media; ``None`` when the signature names no media argument."""
    names = set(media_inputs)
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    values = dict(bound.arguments) if bound is not None else dict(kwargs)
    params = inspect.signature(forward).parameters if callable(forward) else {}
    if not any(name in names for name in (*params, *values, *kwargs)):
        return None
    values = {**kwargs, **values}
    return any(_present(values.get(name)) for name in names)


def forward_may_take_media(
    root: nn.Module, media_inputs: Iterable[str] = DEFAULT_MEDIA_INPUTS
) -> bool:
    """Whether ``root.forward`` names a media argument or takes ``**kwargs``: the
    condition for installing the guard (and for costing its all-reduce)."""
    try:
        params = inspect.signature(root.forward).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    names = set(media_inputs)
    return any(name in names for name in params)


def install_uneven_media_guard(
    root: nn.Module,
    *,
    modules: Sequence[str],
    device: torch.device,
    media_inputs: Iterable[str] = DEFAULT_MEDIA_INPUTS,
) -> bool:
    """Check media agreement before every forward of ``root``; returns whether installed.

    ``modules`` are the multimodal modules whose units make uneven media unsafe
    (named in the error). Nothing is installed on a single rank, or when the
    forward signature names no media argument (then a warning says the check
    is impossible).
    """
    if getattr(root, _GUARD_ATTR, False) or not modules:
        return False
    names = tuple(media_inputs)
    if not forward_may_take_media(root, names):
        # FSDP2 swaps the class for a subclass named "FSDP<name>": report the model's own.
        cls = next(c for c in type(root).__mro__ if not c.__name__.startswith("FSDP"))
        logger.warning(
            "%s.forward takes none of %s; uneven media across ranks cannot be detected and "
            "would hang the units of %s",
            cls.__name__,
            names,
            list(modules),
        )
        return False
    listed = ", ".join(repr(m) for m in modules)

    def guard(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        # None (no media argument in this call's signature) counts as "no media".
        has = batch_has_media(module.forward, args, kwargs, names)
        flag = 1.0 if has else 0.0
        both = torch.tensor([flag, -flag], device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if both[0].item() != -both[1].item():
            raise UnevenMediaError(
                f"rank {dist.get_rank()}: some ranks have media in this batch and others do "
                f"not, but {listed} own FSDP units that only ranks with media would run, so "
                "their collectives would not line up (a hang). Give every rank media in each "
                "step (e.g. a dummy image), or, for a frozen tower, use "
                "frozen_multimodal_sharding='root' or 'replicate', which allow uneven media."
            )

    root.register_forward_pre_hook(guard, prepend=True, with_kwargs=True)
    setattr(root, _GUARD_ATTR, True)
    return True
