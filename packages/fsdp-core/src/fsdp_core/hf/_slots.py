"""The model's tensors as the checkpoint load and export see them (shared by both).

A tensor with several names (tied parameters) is one ``Slot``: it is read once and
written once, under whichever name the checkpoint uses.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_core.hf import _hf_model, _lora
from fsdp_core.hf._safetensors_dir import require_safetensors
from fsdp_core.module_tree import check_unchanged_since_sharding
from fsdp_core.rank_wait import names_text

PathLike = str | os.PathLike[str]

#: Module state name (``model.language_model.layers.0.mlp.up_proj.weight``) -> checkpoint key.
KeyMapping = Callable[[str], str]

_LISTED = 8


@dataclass(frozen=True)
class Slot:
    """One tensor of the model's state and every name it has (tied aliases)."""

    names: tuple[str, ...]
    tensor: torch.Tensor


def persistent_slots(model: nn.Module) -> list[Slot]:
    """Parameters and persistent buffers, aliases grouped, in module order."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        entries = list(module._parameters.items()) + [
            (n, b)
            for n, b in module._buffers.items()
            if n not in module._non_persistent_buffers_set
        ]
        for name, tensor in entries:
            if tensor is None:
                continue
            names.setdefault(id(tensor), []).append(dot + name)
            tensors[id(tensor)] = tensor
    return [Slot(tuple(dict.fromkeys(group)), tensors[key]) for key, group in names.items()]


def renamed(slots: Sequence[Slot], table: Mapping[str, str], cut: str = "") -> list[Slot]:
    """The slots with a name in ``table`` (once the prefix ``cut`` is cut), under its names."""
    out: list[Slot] = []
    for slot in slots:
        inner = [n[len(cut) :] for n in slot.names if n.startswith(cut)]
        names = tuple(dict.fromkeys(table[n] for n in inner if n in table))
        if names:
            out.append(Slot(names, slot.tensor))
    return out


def check_call(model: nn.Module, where: str, key_mapping: object = None) -> None:
    """Refusals that need no tensor, before the model is touched."""
    require_safetensors()
    check_unchanged_since_sharding(model, where=where)
    if key_mapping is not None and not callable(key_mapping):
        raise TypeError(
            f"key_mapping must be a function of a module name, got {type(key_mapping).__name__}"
        )


def reshard(model: nn.Module) -> None:
    """Sharded parameters registered (not an unsharded view left by a forward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def listed(names: Iterable[str]) -> str:
    """The first names, sorted, for an error message that stays readable."""
    return names_text(sorted(names), _LISTED, as_list=True)


def hf_names(model: nn.Module, slots: Sequence[Slot]) -> dict[str, str]:
    """Module name -> checkpoint key as the model's ``save_pretrained`` writes it.

    ``slots`` under adapter-wrapped names (a load into a peft-wrapped model; the
    export passes unwrapped names) have no key in a base checkpoint: refused.
    """
    wrapped = _lora.wrapped_names(model, [name for slot in slots for name in slot.names])
    if wrapped:
        raise _lora.wrapped_load_error(model, wrapped)
    return _hf_model.checkpoint_names(model, [slot.names for slot in slots])
