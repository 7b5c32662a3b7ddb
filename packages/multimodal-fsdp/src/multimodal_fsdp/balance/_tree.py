"""A tower output's structure with its tensors taken out, and put back.

Layouts cut every tensor of an output into per-item pieces, whatever holds them (a
tuple or list, a mapping, a dataclass such as a transformers ``ModelOutput``, nested),
and rebuild an output of the same structure and types from joined pieces; the probe
and the layouts' checks use the same walk to find an argument's tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

_MAX_DEPTH = 8


def take_tensors_out(value: Any, leaves: list[Tensor], depth: int = 0) -> Any:
    """The structure of ``value`` with every tensor replaced by ("leaf", index)."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"tower output nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, Tensor):
        leaves.append(value)
        return ("leaf", len(leaves) - 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(f.name for f in dataclasses.fields(value) if f.init)
        children = tuple(take_tensors_out(getattr(value, n), leaves, depth + 1) for n in names)
        return ("dataclass", type(value), names, children)
    if isinstance(value, Mapping):
        keys = tuple(value.keys())
        children = tuple(take_tensors_out(value[k], leaves, depth + 1) for k in keys)
        return ("mapping", type(value), keys, children)
    if isinstance(value, (tuple, list)):
        children = tuple(take_tensors_out(v, leaves, depth + 1) for v in value)
        return ("sequence", type(value), children)
    return ("const", value)


def put_tensors_back(tree: Any, leaves: Sequence[Tensor]) -> Any:
    """The value ``take_tensors_out`` walked, rebuilt with its own types around ``leaves``."""
    kind = tree[0]
    if kind == "leaf":
        return leaves[tree[1]]
    if kind == "const":
        return tree[1]
    if kind == "dataclass":
        _, cls, names, children = tree
        return cls(**{n: put_tensors_back(c, leaves) for n, c in zip(names, children, strict=True)})
    if kind == "mapping":
        _, cls, keys, children = tree
        return cls([(k, put_tensors_back(c, leaves)) for k, c in zip(keys, children, strict=True)])
    _, cls, children = tree
    values = [put_tensors_back(c, leaves) for c in children]
    if cls is tuple or cls is list:
        return cls(values)
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):  # a namedtuple
        return cls(*values)
    return cls(values)
