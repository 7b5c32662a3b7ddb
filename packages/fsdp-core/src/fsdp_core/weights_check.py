"""A model sharded on ``meta`` must get its weights before its first forward.

Sharding on ``meta`` then ``to_empty()`` allocates every shard without a value; a
forgotten load trains on whatever the memory held, failing deep inside (CLIP's
``position_ids``: ``IndexError: index out of range in self``) or computing garbage without
a word (a rotary ``inv_freq``). Non-persistent buffers are in no checkpoint, so a model
resumed with ``load_checkpoint`` after ``to_empty()`` still has them undefined.

Applying a plan records what was on ``meta``
([record_meta_tensors][fsdp_core.weights_check.record_meta_tensors]); the first forward
raises [UninitializedWeightsError][fsdp_core.weights_check.UninitializedWeightsError] (on
every rank alike), naming them and the loader to call, when some are still on ``meta``,
when no parameter was written since (version counter, or the tag this library's loaders
set: they write local shards, which a DTensor's counter does not see), or when a
non-persistent buffer was never written. Writes the check cannot see are declared with
[mark_weights_loaded][fsdp_core.weights_check.mark_weights_loaded].
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_core.rank_wait import names_text

__all__ = [
    "MetaTensors",
    "UninitializedWeightsError",
    "check_weights_given",
    "mark_weights_loaded",
    "mark_written",
    "meta_tensors",
    "record_meta_tensors",
    "recorded",
    "refill_unset_buffers",
    "sentinel_fill",
    "still_sentinel",
    "unset_buffers",
]

logger = logging.getLogger(__name__)

#: Attribute a loader of this library sets on a tensor it wrote (local shards included).
_WRITTEN: Final = "_fsdp_core_written"
_LIMIT: Final = 4


class UninitializedWeightsError(RuntimeError):
    """A model sharded on ``meta`` reached its first forward without its weights."""


@dataclass(frozen=True)
class MetaTensors:
    """The parameters and non-persistent buffers of a model that were on ``meta`` when
    it was sharded (names as ``named_parameters`` / ``named_buffers`` give them)."""

    parameters: tuple[str, ...]
    buffers: tuple[str, ...]


#: Each sharded model (the one the plan was applied to) -> what was on ``meta`` then.
_RECORDS: weakref.WeakKeyDictionary[nn.Module, MetaTensors] = weakref.WeakKeyDictionary()


def is_meta(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local shard) still has no storage."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).is_meta


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers no checkpoint holds, by name: the model computes them (or a loader's
    ``buffers=`` gives them). Shared with the checkpoint load."""
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, buffer in module._buffers.items():
            if buffer is not None and name in module._non_persistent_buffers_set:
                found[dot + name] = buffer
    return found


def meta_tensors(model: nn.Module) -> MetaTensors | None:
    """What of ``model`` is on ``meta`` now; ``None`` when nothing is.

    Args:
        model: any model.

    Returns:
        Its parameters and buffers on ``meta``, or None.
    """
    params = tuple(n for n, p in model.named_parameters() if is_meta(p))
    buffers = tuple(n for n, b in non_persistent_buffers(model).items() if b.is_meta)
    if not params and not buffers:
        return None
    return MetaTensors(params, buffers)


def record_meta_tensors(model: nn.Module) -> MetaTensors | None:
    """Remember what of the just-sharded ``model`` is on ``meta`` (for
    [check_weights_given][fsdp_core.weights_check.check_weights_given] and the loaders).

    Args:
        model: the model just sharded.

    Returns:
        What was recorded, or None when nothing is on ``meta``.
    """
    record = meta_tensors(model)
    if record is not None:
        _RECORDS[model] = record
    return record


def recorded(model: nn.Module) -> tuple[nn.Module, MetaTensors] | None:
    """The sharded model (``model``, or the one inside it, such as a ``PeftModel``'s) and
    what of it was on ``meta`` when it was sharded.

    Args:
        model: a sharded model or a wrapper of one.

    Returns:
        ``(sharded model, record)``, or None when nothing was on ``meta``.
    """
    for module in model.modules():
        record = _RECORDS.get(module)
        if record is not None:
            return module, record
    return None


def mark_written(tensor: torch.Tensor) -> None:
    """Tag ``tensor`` as given a value by a loader (which may write only its local shard).

    Args:
        tensor: a parameter or buffer a loader wrote.
    """
    try:
        setattr(tensor, _WRITTEN, True)
    except (AttributeError, TypeError):  # a tensor type that takes no attributes
        logger.debug("could not tag a %s as written", type(tensor).__name__)


def mark_weights_loaded(model: nn.Module) -> None:
    """Declare that every parameter and buffer of ``model`` holds its value: for weights
    written in a way the first-forward check cannot see (into the local shards, or by
    ``torch.distributed.checkpoint.load`` without ``set_model_state_dict``).

    Args:
        model: the model whose weights were written.
    """
    for tensor in (*model.parameters(), *model.buffers()):
        mark_written(tensor)


def _written(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, _WRITTEN, False)) or tensor._version > 0


def unset_buffers(model: nn.Module) -> list[str]:
    """The non-persistent buffers of ``model`` that were on ``meta`` when it was sharded,
    are allocated now and were never written since (undefined values).

    Args:
        model: a sharded model.

    Returns:
        Their qualified names.
    """
    found = recorded(model)
    if found is None:
        return []
    sharded, record = found
    buffers = non_persistent_buffers(sharded)
    return [
        name
        for name in record.buffers
        if name in buffers and not buffers[name].is_meta and not _written(buffers[name])
    ]


def sentinel_fill(buffer: torch.Tensor) -> None:
    """Fill ``buffer`` with a value no initialisation writes (NaN, the integer minimum),
    so that [still_sentinel][fsdp_core.weights_check.still_sentinel] tells whether
    something gave it a value since.

    Args:
        buffer: a freshly allocated buffer.
    """
    with torch.no_grad():
        if buffer.dtype.is_floating_point or buffer.dtype.is_complex:
            buffer.fill_(float("nan"))
        elif buffer.dtype != torch.bool:
            buffer.fill_(torch.iinfo(buffer.dtype).min)


def still_sentinel(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` still holds what [sentinel_fill][fsdp_core.weights_check.sentinel_fill]
    wrote (never for an empty or bool buffer).

    Args:
        buffer: a buffer ``sentinel_fill`` filled.

    Returns:
        Whether nothing wrote it since.
    """
    if buffer.numel() == 0 or buffer.dtype == torch.bool:
        return False
    if buffer.dtype.is_floating_point or buffer.dtype.is_complex:
        return bool(torch.isnan(buffer).all())
    return bool((buffer == torch.iinfo(buffer.dtype).min).all())


def refill_unset_buffers(model: nn.Module) -> list[str]:
    """Recompute the [unset_buffers][fsdp_core.weights_check.unset_buffers] of a
    transformers model with its own buffer initialisation (as ``load_pretrained`` does);
    other models are left to the first forward's check.

    Args:
        model: a sharded model.

    Returns:
        The names of the buffers recomputed.
    """
    found = recorded(model)
    names = unset_buffers(model)
    if found is None or not names:
        return []
    # Imported here so that ``import fsdp_core`` does not load the checkpoint I/O.
    from fsdp_core.hf import _hf_model

    sharded = found[0]
    if not _hf_model.is_hf_model(sharded):
        return []
    buffers = non_persistent_buffers(sharded)
    for name in names:
        sentinel_fill(buffers[name])
    ran = _hf_model.recompute_buffers(sharded, names)
    done = [n for n in ran if not still_sentinel(buffers[n])]
    logger.info("recomputed %d non-persistent buffers after to_empty: %s", len(done), done)
    return done


_LOADERS: Final = (
    "fsdp_core.hf.load_pretrained(model, directory) for a Hugging Face checkpoint "
    "directory (it allocates the model itself, no to_empty() needed, and recomputes "
    "non-persistent buffers), fsdp_core.load_checkpoint(directory, model) for a checkpoint "
    "saved with save_checkpoint, fsdp_core.materialize_from_full(model, named_full_tensors, "
    "device=...) or fsdp_core.load_full_state_dict(model, state_dict) for tensors you hold"
)


def check_weights_given(model: nn.Module, record: MetaTensors, *, name: str) -> None:
    """Raise [UninitializedWeightsError][fsdp_core.weights_check.UninitializedWeightsError]
    if what ``record`` says was on ``meta`` has no values yet (see the module docstring).

    Args:
        model: the sharded model.
        record: what was on ``meta`` when it was sharded.
        name: the model's class name, for the message.

    Raises:
        UninitializedWeightsError: a recorded tensor was never given a value.
    """
    params = dict(model.named_parameters())
    buffers = non_persistent_buffers(model)
    still = [n for n in record.parameters if n in params and is_meta(params[n])]
    still += [n for n in record.buffers if n in buffers and buffers[n].is_meta]
    if still:
        raise UninitializedWeightsError(
            f"{name} was sharded on the meta device and {len(still)} of its tensors are "
            f"still there ({names_text(still, _LIMIT)}): it has no weights to run with. "
            f"Load them after parallelize: {_LOADERS}."
        )
    wanted = [params[n] for n in record.parameters if n in params]
    if wanted and not any(_written(p) for p in wanted):
        raise UninitializedWeightsError(
            f"{name} was sharded on the meta device and none of its {len(wanted)} "
            "parameters has been given a value since: to_empty() allocates memory without "
            "values, and no weights were loaded. Load them after parallelize: "
            f"{_LOADERS}. If you wrote the values in a way this check cannot see (into "
            "param.to_local(), or torch.distributed.checkpoint.load without "
            "set_model_state_dict), call fsdp_core.weights_check.mark_weights_loaded(model) first."
        )
    unset = unset_buffers(model)
    if unset:
        raise UninitializedWeightsError(
            f"{name} was sharded on the meta device and its non-persistent buffers "
            f"{names_text(unset, _LIMIT)} were never given values after to_empty(): no "
            "checkpoint or state dict holds them. Recompute them: "
            "fsdp_core.hf.load_pretrained does it for transformers models (and "
            "load_checkpoint / load_full_state_dict for transformers models too), "
            "materialize_from_full takes buffers={name: tensor}, or copy the values in place "
            "(model.get_buffer(name).copy_(value))."
        )
