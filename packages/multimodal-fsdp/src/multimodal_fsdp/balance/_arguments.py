"""A tower call's arguments by name, read against the tower's forward signature.

Layouts split calls by argument name, whether the caller passed them by position or by
keyword, and rebuild calls that pass positional-only arguments by position; the
arguments a layout does not cut pass through unchanged and must hold no tensors.

Tensors that reach a tower only through its ``**kwargs`` are left out of the balanced
call. A transformers model forwards its own extra keyword arguments to every submodule,
so a tower receives text-side tensors it never reads (Qwen2.5-Omni's and Gemma 3's
``mm_token_type_ids``, one value per text token) and values precomputed from the call's
items (``cu_seqlens``, ``position_ids``, ``window_index``), which the tower computes
again from the items of the call it makes when they are absent, as it must for a
balanced call that holds other items. The plan-time probe runs the tower without them.
0-d tensors (``num_items_in_batch``) are kept: they travel with each item. The names
left out are logged once per tower class: a custom tower that reads a per-item tensor
from its ``**kwargs`` must name it in its forward to have it cut with the items.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from multimodal_fsdp.balance._tree import take_tensors_out
from multimodal_fsdp.balance.layouts import CallSpec

logger = logging.getLogger(__name__)

#: (tower class, names) already logged as left out, so a step logs nothing new.
_LOGGED: set[tuple[str, tuple[str, ...]]] = set()


def forward_signature(tower: nn.Module) -> inspect.Signature:
    """The signature a call of ``tower`` is bound against (its ``forward``)."""
    return inspect.signature(tower.forward)


def named_parameters(tower: nn.Module) -> dict[str, inspect.Parameter]:
    """The forward's parameters a call can name (not ``*args`` or ``**kwargs``)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p for n, p in forward_signature(tower).parameters.items() if p.kind not in variadic}


def _forwarded(value: Any) -> bool:
    """Whether a value passed through ``**kwargs`` is left out of a balanced call: it holds
    tensors and is not a 0-d tensor (see the module docstring)."""
    if isinstance(value, Tensor):
        return value.dim() > 0
    leaves: list[Tensor] = []
    take_tensors_out(value, leaves)
    return bool(leaves)


def arguments_by_name(
    tower: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The call's arguments by name, ``**kwargs`` merged in (less the tensors the model
    forwards to every submodule, see the module docstring), defaults left out."""
    signature = forward_signature(tower)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"cannot bind the call to {type(tower).__name__}.forward{signature}: {error}"
        ) from None
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update({key: v for key, v in value.items() if not _forwarded(v)})
            _log_left_out(tower, sorted(key for key, v in value.items() if _forwarded(v)))
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(
                    f"{type(tower).__name__}.forward takes *{name}; a balanced call cannot "
                    f"name its extra positional arguments {len(value)}"
                )
        else:
            named[name] = value
    return named


def _log_left_out(tower: nn.Module, names: list[str]) -> None:
    key = (type(tower).__qualname__, tuple(names))
    if names and key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(
            "balance_media: tensors %s reach %s.forward only through its **kwargs and are "
            "left out of its balanced calls (the tower recomputes or ignores them; name a "
            "per-item argument in the forward to have it cut with the items)",
            names,
            type(tower).__name__,
        )


def call_spec(
    tower: nn.Module,
    layout: str,
    named: Mapping[str, Any],
    fields: Sequence[str],
    scalars: Sequence[str],
    rebuilt: Sequence[str] = (),
) -> CallSpec:
    """The spec of a call cut into ``fields`` and ``scalars`` (``rebuilt``: arguments the
    layout rebuilds from the items). The other arguments pass through and must hold no
    tensor: a tensor there spans items the layout cannot cut."""
    constants = {n: v for n, v in named.items() if n not in (*fields, *scalars, *rebuilt)}
    for name, value in constants.items():
        leaves: list[Tensor] = []
        take_tensors_out(value, leaves)
        if leaves:
            raise ValueError(
                f"the {layout!r} layout cannot split argument {name!r} of "
                f"{type(tower).__name__}.forward (it holds tensors that are not one row per "
                "item); register a layout adapter that knows it (register_media_layout)"
            )
    parameters = forward_signature(tower).parameters.items()
    return CallSpec(
        fields=(*fields, *scalars),
        constants=tuple(constants.items()),
        positional=tuple(n for n, p in parameters if p.kind is inspect.Parameter.POSITIONAL_ONLY),
        scalars=tuple(scalars),
    )


def scalar_arguments(named: Mapping[str, Any]) -> list[str]:
    """The names of the 0-d tensor arguments of a call: passed through, not cut by item."""
    return [n for n, v in named.items() if isinstance(v, Tensor) and v.dim() == 0]


def scalar_rows(named: Mapping[str, Any], names: Sequence[str]) -> tuple[Tensor, ...]:
    """One item's rows of the scalar fields ``names``: each 0-d value as a 1-row tensor."""
    return tuple(named[n].reshape(1) for n in names)


def indexed_like_items(
    tower: nn.Module,
    named: Mapping[str, Any],
    known: Sequence[str],
    rows: Sequence[int],
    layout: str,
    grid_argument: str,
) -> tuple[list[str], list[str]]:
    """The call's other tensor arguments (not in ``known``), each indexed like the patches
    (one row per patch: split with them) or like the items (one row per ``grid_argument``
    row: split with it); any other is an error naming it (it spans all items)."""
    per_row: list[str] = []
    per_item: list[str] = []
    others: list[str] = []
    for name, value in sorted(named.items()):
        if not isinstance(value, Tensor) or name in known:
            continue
        if value.dim() >= 1 and value.shape[0] == sum(rows):
            per_row.append(name)
        elif value.dim() >= 1 and value.shape[0] == len(rows):
            per_item.append(name)
        else:
            others.append(name)
    if others:
        raise ValueError(
            f"the {layout!r} layout cannot split the tensor arguments {others} of "
            f"{type(tower).__name__}.forward: they have neither one row per patch "
            f"({sum(rows)}) nor one per item ({len(rows)}), so they span all items; "
            f"leave them out (the tower computes them from {grid_argument}) or "
            "register a layout adapter that knows them (register_media_layout)"
        )
    return per_row, per_item
