"""A placeholder call of a module another rank calls: its shapes, with harmless values.

A module that owns FSDP units and runs only on ranks with media (a projector, a
cross-attention decoder layer) must run on every rank, or its all-gathers meet other
collectives. A caller describes its call (``describe_call``: each tensor's dtype, shape
and requires-grad, plain values as they are, other objects as ``None``) and the others
rebuild it (``placeholder_call``): zeros for floating tensors, ones for the others (an
all-valid mask, in-range indices), so the module stays finite and its output, times 0,
changes nothing; a floating leaf requires grad where the real one did, so the
placeholder's backward runs as the real call's does.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import Tensor

__all__ = ["describe_call", "placeholder_call"]

_MAX_DEPTH: Final = 8
_PLAIN: Final = (bool, int, float, str, type(None))


def _describe(value: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        return ("const", None)
    if isinstance(value, Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), bool(value.requires_grad))
    if isinstance(value, _PLAIN):
        return ("const", value)
    if isinstance(value, Mapping) and type(value) is dict:
        return ("dict", tuple((str(k), _describe(v, depth + 1)) for k, v in value.items()))
    if type(value) in (tuple, list):
        return ("seq", type(value) is tuple, tuple(_describe(v, depth + 1) for v in value))
    if isinstance(value, torch.dtype):
        return ("dtype", str(value))
    return ("const", None)


def describe_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    """The shapes of a call, pickled (what a rank without the call rebuilds it from).

    Args:
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.

    Returns:
        The description, as bytes to send.
    """
    tree = (
        tuple(_describe(value) for value in args),
        tuple((name, _describe(value)) for name, value in kwargs.items()),
    )
    return pickle.dumps(tree)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a placeholder description")
    return dtype


def _build(node: Any, device: torch.device) -> Any:
    kind = node[0]
    if kind == "tensor":
        _, name, shape, requires_grad = node
        dtype = _dtype(name)
        if dtype.is_floating_point or dtype.is_complex:
            return torch.zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)
        return torch.ones(shape, dtype=dtype, device=device)
    if kind == "const":
        return node[1]
    if kind == "dict":
        return {key: _build(child, device) for key, child in node[1]}
    if kind == "seq":
        values = [_build(child, device) for child in node[2]]
        return tuple(values) if node[1] else values
    if kind == "dtype":
        return _dtype(node[1])
    raise ValueError(f"unknown node {kind!r} in a placeholder description")


def placeholder_call(blob: bytes, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Call arguments shaped like those ``describe_call`` described (see the module
    docstring), on ``device``.

    Args:
        blob: what ``describe_call`` returned on the calling rank.
        device: where the placeholder tensors go.

    Returns:
        ``(args, kwargs)`` of the placeholder call.
    """
    args, kwargs = pickle.loads(blob)  # our own group's bytes
    return (
        tuple(_build(node, device) for node in args),
        {name: _build(node, device) for name, node in kwargs},
    )
