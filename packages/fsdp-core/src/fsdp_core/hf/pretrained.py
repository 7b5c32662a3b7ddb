"""Pretrained weights in, trained weights out: Hugging Face checkpoint directories.

[`load_pretrained`][fsdp_core.hf.pretrained.load_pretrained] fills a model that was built on the
``meta`` device and sharded from a directory written by ``save_pretrained`` (one
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files with
``model.safetensors.index.json``). Every rank reads only the slices of its own shards
(``safe_open(...).get_slice``), with no communication; parameters that are not sharded (replicated,
FSDP-ignored) and persistent buffers are read whole on every rank. Per rank, host memory holds
one tensor's slice at a time beyond the shards themselves (the files are memory
mapped: their pages sit in the node's shared page cache).

[`save_pretrained`][fsdp_core.hf.pretrained.save_pretrained] gathers the trained model into the same
layout on rank 0, one output file at a time, so that ``transformers`` ``from_pretrained`` loads it.

Needs the ``safetensors`` package (the ``fsdp-core[hf]`` extra); transformers is
never imported: its models are recognised by their ``save_pretrained`` methods.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp_core import _export_swap
from fsdp_core.collective_entry import CollectiveCall, enter_collective, group_ranks
from fsdp_core.dtype_units import dominant_dtype
from fsdp_core.hf import _hf_model, _lora, _lora_load
from fsdp_core.hf import _transformers as tf
from fsdp_core.hf._safetensors_dir import (
    CheckpointLayout,
    SafeFile,
    file_names,
    is_floating_code,
    is_weight_file,
    open_file,
    plan_files,
    read_layout,
    require_safetensors,
    verify_export,
    write_file,
    write_index,
)
from fsdp_core.materialize import copy_full_into_
from fsdp_core.module_tree import check_unchanged_since_sharding
from fsdp_core.sizes import parse_size
from fsdp_core.weights_check import mark_weights_loaded, sentinel_fill, still_sentinel

__all__ = ["KeyMapping", "PretrainedLoad", "load_pretrained", "save_pretrained"]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

#: Module state name (``model.language_model.layers.0.mlp.up_proj.weight``) -> checkpoint key.
KeyMapping = Callable[[str], str]

_LISTED = 8
#: The largest export file by default, whichever way the export is called: rank 0 holds
#: one output file of full tensors at a time, so this bounds its host memory (smaller
#: than transformers' own 50GB default, which assumes the model is already in memory).
DEFAULT_MAX_SHARD_SIZE = "5GB"


@dataclass(frozen=True)
class PretrainedLoad:
    """What [`load_pretrained`][fsdp_core.hf.pretrained.load_pretrained] did.

    ``naming`` says how module names were matched to checkpoint keys:
    ``"module"`` (the same names), ``"save_pretrained"`` (the names the model's own
    ``save_pretrained`` writes), ``"key_mapping"`` (the caller's function) or
    ``"adapter"`` (an adapter export, by the names peft writes).
    ``missing`` and ``unexpected`` are empty unless ``strict=False``; ``ignored``
    lists checkpoint keys the model declines on purpose (see
    [`load_pretrained`][fsdp_core.hf.pretrained.load_pretrained]).
    """

    directory: str
    naming: str
    files: tuple[str, ...]
    loaded: tuple[str, ...]
    cast: tuple[str, ...]
    recomputed_buffers: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Slot:
    """One tensor of the model's state and every name it has (tied aliases)."""

    names: tuple[str, ...]
    tensor: torch.Tensor


def _persistent_slots(model: nn.Module) -> list[_Slot]:
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
    return [_Slot(tuple(dict.fromkeys(group)), tensors[key]) for key, group in names.items()]


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, buffer in module._buffers.items():
            if buffer is not None and name in module._non_persistent_buffers_set:
                found[dot + name] = buffer
    return found


def _reshard(model: nn.Module) -> None:
    """Sharded parameters registered (not an unsharded view left by a forward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _is_meta(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.is_meta


def _default_device(model: nn.Module) -> torch.device:
    for param in model.parameters():
        if isinstance(param, DTensor):
            kind = param.device_mesh.device_type
            if kind == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(kind)
    return torch.device("cpu")


# ------------------------------------------------------------------------- naming


def _listed(names: Iterable[str]) -> str:
    items = sorted(names)
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return f"{items[:_LISTED]}{more}"


@dataclass(frozen=True)
class _Match:
    naming: str
    keys: dict[str, str]  # every module name of a matched tensor -> its checkpoint key
    matched: int
    missing: tuple[str, ...]
    expected: tuple[str, ...]
    unexpected: tuple[str, ...]

    @property
    def problems(self) -> int:
        return len(self.missing) + len(self.unexpected)


def _match(naming: str, slots: Sequence[_Slot], keys: Iterable[str], rename: KeyMapping) -> _Match:
    available = set(keys)
    chosen: dict[str, str] = {}
    missing: list[str] = []
    expected: list[str] = []  # checkpoint keys of missing tensors, where renamed
    for slot in slots:
        key = next((k for k in map(rename, slot.names) if k in available), None)
        if key is None:
            missing.append(slot.names[0])
            wanted = rename(slot.names[0])
            if wanted != slot.names[0]:
                expected.append(wanted)
        else:
            chosen.update(dict.fromkeys(slot.names, key))
    unexpected = tuple(sorted(available - set(chosen.values())))
    matched = len(slots) - len(missing)
    return _Match(naming, chosen, matched, tuple(missing), tuple(expected), unexpected)


def _hf_names(model: nn.Module, slots: Sequence[_Slot]) -> dict[str, str]:
    """Module name -> checkpoint key as the model's ``save_pretrained`` writes it.

    ``slots`` under adapter-wrapped names (a load into a peft-wrapped model; the
    export passes unwrapped names) have no key in a base checkpoint: refused.
    """
    wrapped = _lora.wrapped_names(model, [name for slot in slots for name in slot.names])
    if wrapped:
        raise _lora.wrapped_load_error(model, wrapped)
    return _hf_model.checkpoint_names(model, [slot.names for slot in slots])


def _declined(model: nn.Module, keys: Iterable[str]) -> set[str]:
    """Checkpoint keys the model has no use for by design.

    A key whose last part names a non-persistent buffer of the model (an
    ``inv_freq`` older checkpoints saved) holds what the model computes itself;
    transformers models also list patterns in ``_keys_to_ignore_on_load_unexpected``.
    """
    leaves = {name.rpartition(".")[2] for name in _non_persistent_buffers(model)}
    patterns = getattr(model, tf.KEYS_TO_IGNORE_ON_LOAD_UNEXPECTED, None) or []
    if not isinstance(patterns, (list, tuple, set)):
        patterns = []
    return {
        key
        for key in keys
        if key.rpartition(".")[2] in leaves
        or any(isinstance(p, str) and re.search(p, key) for p in patterns)
    }


def _resolve(
    model: nn.Module, slots: Sequence[_Slot], keys: Iterable[str], key_mapping: KeyMapping | None
) -> _Match:
    keys = list(keys)
    if key_mapping is not None:
        return _match("key_mapping", slots, keys, key_mapping)
    same = _match("module", slots, keys, lambda name: name)
    if same.problems == 0 or not _hf_model.is_hf_model(model):
        return same
    table = _hf_names(model, slots)
    renamed = _match("save_pretrained", slots, keys, lambda name: table.get(name, name))
    return renamed  # neither fits: report against the names transformers itself writes


# ------------------------------------------------------------------------- reading


def _coordinate(mesh: DeviceMesh) -> tuple[int, ...] | None:
    """This rank's place in ``mesh``, from the process groups FSDP shards over."""
    if not dist.is_initialized():
        return mesh.get_coordinate()
    ranks = tuple(dist.get_rank(mesh.get_group(dim)) for dim in range(mesh.ndim))
    return None if any(rank < 0 for rank in ranks) else ranks


def _local_region(tensor: DTensor) -> tuple[slice, ...] | None:
    """The box of the global tensor this rank holds, for ``Shard``/``Replicate`` layouts.

    Follows ``torch.chunk`` (as FSDP2 and DTensor do); ``None`` for any other
    placement or if the result disagrees with the local shard's shape.
    """
    mesh = tensor.device_mesh
    coordinate = _coordinate(mesh)
    if coordinate is None:
        return None
    bounds = [(0, size) for size in tensor.shape]
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            return None
        dim = placement.dim % tensor.dim()
        start, stop = bounds[dim]
        length = stop - start
        chunk = -(-length // mesh.size(mesh_dim))
        low = min(coordinate[mesh_dim] * chunk, length)
        high = min(low + chunk, length)
        bounds[dim] = (start + low, start + high)
    if tuple(high - low for low, high in bounds) != tuple(tensor.to_local().shape):
        return None
    return tuple(slice(low, high) for low, high in bounds)


def _check_kinds(key: str, code: str, name: str, target: torch.Tensor) -> None:
    if is_floating_code(code) != target.dtype.is_floating_point:
        raise TypeError(
            f"checkpoint key {key!r} holds {code} values but {name!r} is {target.dtype}: "
            "floating and integer tensors do not convert into each other"
        )


def _read_into(handle: SafeFile, key: str, slot: _Slot) -> str:
    """Copy the checkpoint tensor ``key`` into ``slot`` (only the local shard); its dtype code."""
    lazy = handle.get_slice(key)
    shape, code = tuple(lazy.get_shape()), lazy.get_dtype()
    target = slot.tensor
    if shape != tuple(target.shape):
        raise ValueError(
            f"checkpoint key {key!r} has shape {shape}, the model's {slot.names[0]!r} "
            f"{tuple(target.shape)}"
        )
    _check_kinds(key, code, slot.names[0], target)
    with torch.no_grad():
        if not isinstance(target, DTensor):
            target.copy_(handle.get_tensor(key).to(device=target.device, dtype=target.dtype))
            return code
        region = _local_region(target)
        if region is None:  # an unusual layout: read it whole, keep the local part
            copy_full_into_(target, handle.get_tensor(key))
            return code
        local = target.to_local()
        if local.numel():
            local.copy_(lazy[region].to(device=local.device, dtype=local.dtype))
    return code


def _copy_full(target: torch.Tensor, value: torch.Tensor) -> None:
    """A full tensor into ``target``: this rank's box of it, as the checkpoint reads cut it."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"a full tensor of {tuple(value.shape)} for one of {tuple(target.shape)}")
    region = _local_region(target) if isinstance(target, DTensor) else None
    if region is None or not isinstance(target, DTensor):
        copy_full_into_(target, value)
        return
    local = target.to_local()
    with torch.no_grad():
        if local.numel():
            local.copy_(value[region].to(device=local.device, dtype=local.dtype))


def _code_of(dtype: torch.dtype) -> str:
    codes = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    return codes.get(dtype, str(dtype))


def _load_tensors(layout: CheckpointLayout, slots: Sequence[_Slot], match: _Match) -> list[str]:
    """Read every matched slot, file by file; the names whose dtype was cast."""
    by_file: dict[str, list[tuple[str, _Slot]]] = {}
    for slot in slots:
        key = match.keys.get(slot.names[0])
        if key is not None:
            by_file.setdefault(layout.weight_map[key], []).append((key, slot))
    cast: list[str] = []
    for file in sorted(by_file):
        with open_file(layout.directory / file) as handle:
            for key, slot in by_file[file]:
                if _read_into(handle, key, slot) != _code_of(slot.tensor.dtype):
                    cast.extend(slot.names)
    return cast


def _retie(model: nn.Module, slots: Sequence[_Slot]) -> None:
    """``to_empty`` gives each alias of a plain tied parameter its own tensor: share again."""
    for slot in slots:
        if len(slot.names) < 2:
            continue
        first_path, _, first_attr = slot.names[0].rpartition(".")
        first = model.get_submodule(first_path)
        shared: torch.Tensor | None = first._parameters.get(first_attr)
        table = "_parameters"
        if shared is None:
            shared, table = first._buffers[first_attr], "_buffers"
        for name in slot.names[1:]:
            path, _, attr = name.rpartition(".")
            getattr(model.get_submodule(path), table)[attr] = shared


# ------------------------------------------------------------------------- buffers


def _fill_buffers(
    model: nn.Module,
    was_meta: set[str],
    kept: Mapping[str, torch.Tensor],
    given: Mapping[str, torch.Tensor],
) -> list[str]:
    """Give non-persistent buffers their values after ``to_empty``; the recomputed names."""
    buffers = _non_persistent_buffers(model)
    for name in was_meta:
        sentinel_fill(buffers[name])
    recomputed: list[str] = []
    if _hf_model.is_hf_model(model):
        ran = _hf_model.recompute_buffers(model, list(buffers))
        recomputed = [n for n in ran if n not in was_meta or not still_sentinel(buffers[n])]
    with torch.no_grad():
        for name, value in kept.items():
            if name not in recomputed:
                buffers[name].copy_(value)
        for name, value in given.items():
            buffer = model.get_buffer(name)
            buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))
    undefined = [n for n in was_meta if n not in given and still_sentinel(buffers[n])]
    if undefined:
        raise ValueError(
            f"non-persistent buffers {_listed(undefined)} were on the meta device, are not in "
            "any checkpoint and nothing recomputed them: pass buffers={name: tensor}"
        )
    return recomputed


def _check_buffer_names(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    known = {name for name, _ in model.named_buffers()}
    unknown = [name for name in buffers if name not in known]
    if unknown:
        raise ValueError(f"buffers= names {_listed(unknown)}, which are not buffers of the model")


# ------------------------------------------------------------------------- public API


def load_pretrained(
    model: nn.Module,
    directory: PathLike,
    *,
    key_mapping: KeyMapping | None = None,
    buffers: Mapping[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    strict: bool = True,
    timeout: float | timedelta | None = None,
) -> PretrainedLoad:
    """Load a ``save_pretrained`` directory into ``model`` (sharded or not), in place.

    Call it on every rank, after planning and sharding a model built on ``meta``:
    it allocates the model (``to_empty``) on ``device`` (default: the mesh's
    device, else the CPU), reads each rank's slices and casts every tensor to the
    dtype the model holds (an fp32 island stays fp32 whatever the file holds).

    Checkpoint keys are matched to module names as they are, else (transformers
    models) as the model's own ``save_pretrained`` writes them; ``key_mapping``
    (module name -> checkpoint key) overrides both. Tied parameters are read
    once. Non-persistent buffers, which no checkpoint holds, are recomputed by
    transformers models' buffer initialisation; give others in ``buffers``.
    With ``strict`` a checkpoint that lacks a model tensor or holds one the
    model has no place for fails, naming them; otherwise they are returned and
    missing tensors keep what they held (undefined after a ``meta`` build). Keys
    the model declines on purpose (an old saved ``inv_freq``, transformers'
    ``_keys_to_ignore_on_load_unexpected``) are skipped and listed as ``ignored``.

    LoRA (peft): into a ``PeftModel`` (or its base model) the base weights are
    read under their unwrapped names (``q_proj.base_layer.weight`` from
    ``q_proj.weight``; ``modules_to_save`` copies from the module they copy).
    When the load allocates the model (a ``meta`` build), the adapters get
    peft's initial values (``init_lora_weights=True`` or ``"gaussian"``), drawn
    from the default CPU generator in peft's order as full tensors on every
    rank, each rank keeping its shard: seed every rank alike right before the
    load. Other initialisations are refused before anything is read. A
    directory holding an adapter export (``adapter_config.json``,
    ``adapter_model.safetensors``) loads the active adapter into a ``PeftModel``
    whose base weights are loaded. ``key_mapping`` then receives the base
    model's (unwrapped) names.

    Collective: every rank of the model's mesh must call it; it waits at most
    ``timeout`` (default: the process group's timeout) for the others, checks
    that every rank sees the same checkpoint layout and raises a failure of any
    rank on every rank.
    """
    with enter_collective(
        "load_pretrained", ranks=group_ranks(model=model), timeout=timeout
    ) as call:
        layout = call.run(
            lambda: _read_load_layout(directory),
            step=f"reading the layout of {str(directory)!r}",
        )
        call.agree_on(_layout_fingerprint(layout), what=f"checkpoint layout of {str(directory)!r}")
        return call.run(
            lambda: _load(model, directory, layout, key_mapping, buffers, device, strict),
            step=f"loading {str(directory)!r}",
        )


def _read_load_layout(directory: PathLike) -> CheckpointLayout:
    """A model export's layout, else an adapter export's (peft's two files)."""
    try:
        return read_layout(directory)
    except FileNotFoundError:
        root = Path(directory)
        weights = root / _hf_model.ADAPTER_WEIGHTS
        if not (weights.is_file() and (root / _hf_model.ADAPTER_CONFIG).is_file()):
            raise
    with open_file(weights) as handle:
        return CheckpointLayout(root, dict.fromkeys(handle.keys(), _hf_model.ADAPTER_WEIGHTS))


def _is_adapter_layout(layout: CheckpointLayout) -> bool:
    return layout.files == (_hf_model.ADAPTER_WEIGHTS,)


def _renamed(slots: Sequence[_Slot], view: _lora_load.LoadView) -> list[_Slot]:
    """The slots a base checkpoint holds, under the base model's names."""
    out: list[_Slot] = []
    for slot in slots:
        names = tuple(dict.fromkeys(view.names[n] for n in slot.names if n in view.names))
        if names:
            out.append(_Slot(names, slot.tensor))
    return out


def _load_adapter(
    model: nn.Module, directory: PathLike, layout: CheckpointLayout, strict: bool
) -> PretrainedLoad:
    """An adapter export (peft's files) into a loaded peft model: the adapter tensors only."""
    if not _lora.is_peft_model(model):
        raise ValueError(
            f"{str(directory)!r} holds an adapter export (adapter_config.json, "
            f"{_hf_model.ADAPTER_WEIGHTS}); it loads into the PeftModel, not into "
            f"{type(model).__name__}"
        )
    _reshard(model)
    slots = _persistent_slots(model)
    if any(_is_meta(slot.tensor) for slot in slots):
        raise ValueError(
            f"{str(directory)!r} holds an adapter export, but the model still has tensors on "
            "the meta device: load the base checkpoint first (load_pretrained(peft_model, "
            "base_dir)), then the adapter export"
        )
    adapter = _lora.active_adapter(model)
    table, _ = _hf_model.adapter_checkpoint(model, [slot.names for slot in slots], adapter=adapter)
    wanted = [slot for slot in slots if any(name in table for name in slot.names)]
    match = _match("adapter", wanted, layout.weight_map, lambda name: table.get(name, name))
    if match.problems:
        message = (
            f"adapter export {str(directory)!r} does not match adapter {adapter!r} of "
            f"{type(model).__name__}: {len(match.missing)} adapter tensors missing "
            f"{_listed(match.missing)}, {len(match.unexpected)} unexpected keys "
            f"{_listed(match.unexpected)}"
        )
        if strict:
            raise ValueError(message + "; was it saved from a model with the same LoraConfig?")
        logger.warning("%s", message)
    cast = _load_tensors(layout, wanted, match)
    logger.info("loaded adapter %r (%d tensors) from %s", adapter, match.matched, directory)
    return PretrainedLoad(
        directory=str(directory),
        naming="adapter",
        files=layout.files,
        loaded=tuple(match.keys),
        cast=tuple(cast),
        recomputed_buffers=(),
        missing=match.missing,
        unexpected=match.unexpected,
    )


def _layout_fingerprint(layout: CheckpointLayout) -> str:
    text = json.dumps(sorted(layout.weight_map.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _load(
    model: nn.Module,
    directory: PathLike,
    layout: CheckpointLayout,
    key_mapping: KeyMapping | None,
    buffers: Mapping[str, torch.Tensor] | None,
    device: torch.device | str | None,
    strict: bool,
) -> PretrainedLoad:
    """The load on this rank (no collectives), once every rank holds the same layout."""
    require_safetensors()
    check_unchanged_since_sharding(model, where="load_pretrained")
    if key_mapping is not None and not callable(key_mapping):
        raise TypeError(
            f"key_mapping must be a function of a module name, got {type(key_mapping).__name__}"
        )
    if _is_adapter_layout(layout):
        if key_mapping is not None or buffers:
            raise ValueError(
                "key_mapping= and buffers= do not apply to an adapter export (peft names its keys)"
            )
        return _load_adapter(model, directory, layout, strict)
    given = dict(buffers or {})
    _check_buffer_names(model, given)
    _reshard(model)
    slots = _persistent_slots(model)
    view = (
        _lora_load.load_view(
            model,
            [name for slot in slots for name in slot.names],
            initialise=any(_is_meta(slot.tensor) for slot in slots),
        )
        if _lora_load.is_lora_model(model)
        else None
    )
    if view is None:
        match = _resolve(model, slots, layout.weight_map, key_mapping)
    else:
        match = _resolve(view.target, _renamed(slots, view), layout.weight_map, key_mapping)
    ignored = tuple(sorted(_declined(model, match.unexpected)))
    if ignored:
        unexpected = tuple(k for k in match.unexpected if k not in ignored)
        match = dataclasses.replace(match, unexpected=unexpected)
        logger.info("ignoring %d checkpoint keys the model declines: %s", len(ignored), ignored)
    if match.problems:
        message = (
            f"checkpoint {str(directory)!r} does not match {type(model).__name__} "
            f"(names matched as: {match.naming}): {len(match.missing)} model tensors missing "
            f"{_listed(match.missing)}"
            + (f" (looked up as {_listed(match.expected)})" if match.expected else "")
            + f", {len(match.unexpected)} unexpected checkpoint keys {_listed(match.unexpected)}"
        )
        if strict:
            # key_mapping can only help when names differ (tensors missing under one name
            # and unexpected under another); a tensor the checkpoint lacks stays missing.
            remedy = (
                "; pass key_mapping= (model name -> checkpoint key) if the names differ, "
                "or strict=False to load the tensors that match"
                if match.missing and match.unexpected
                else "; pass strict=False to load the tensors that match"
            )
            raise ValueError(message + remedy)
        logger.warning("%s", message)

    non_persistent = _non_persistent_buffers(model)
    was_meta = {name for name, buf in non_persistent.items() if buf.is_meta}
    allocated = any(_is_meta(s.tensor) for s in slots) or bool(was_meta)
    if allocated:
        kept = {n: b.detach().clone() for n, b in non_persistent.items() if n not in was_meta}
        model.to_empty(device=device if device is not None else _default_device(model))
        _retie(model, slots)
        was_meta = set(non_persistent)  # to_empty replaced every buffer
    else:
        kept = {}
    recomputed = _fill_buffers(model, was_meta, kept, given)
    fresh = _persistent_slots(model)
    cast = _load_tensors(layout, fresh if view is None else _renamed(fresh, view), match)
    if view is not None and allocated:  # adapters that held no values: peft's first ones
        _lora_load.initialise_adapters(model, view.adapters, _copy_full)
    mark_weights_loaded(model)  # the reads wrote local shards only (fsdp_core.weights_check)
    logger.info(
        "loaded %d tensors from %s (%d files, names as %s; %d cast to the model's dtype)",
        match.matched,
        directory,
        len(layout.files),
        match.naming,
        len(cast),
    )
    return PretrainedLoad(
        directory=str(directory),
        naming=match.naming,
        files=layout.files,
        loaded=tuple(match.keys),
        cast=tuple(cast),
        recomputed_buffers=tuple(recomputed),
        missing=match.missing,
        unexpected=match.unexpected,
        ignored=ignored,
    )


def _gathered(slot: _Slot, terms: Sequence[_lora.Term], *, keep: bool) -> torch.Tensor | None:
    """The slot's whole tensor with its LoRA ``terms`` merged in (collectives on every rank)."""
    value = _full(slot.tensor, keep=keep)
    parts = [
        (_full(t.up, keep=keep), None if t.down is None else _full(t.down, keep=keep), t)
        for t in terms
    ]
    if value is None or not parts:
        return value
    return _lora.merged(value, [(up, down, t) for up, down, t in parts if up is not None])


def _full(tensor: torch.Tensor, *, keep: bool) -> torch.Tensor | None:
    """The whole tensor on this rank's CPU when ``keep`` (a collective for DTensors)."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            full = tensor.full_tensor()
            return full.detach().cpu() if keep else None
        return tensor.detach().cpu().clone() if keep else None


@dataclass(frozen=True)
class _Export:
    """What a model export writes: checkpoint key -> tensor, what is merged in, whose config."""

    entries: list[tuple[str, _Slot]]
    terms: Mapping[str, tuple[_lora.Term, ...]]  # by checkpoint key: LoRA additions
    config_model: nn.Module


def _unwrapped_slots(
    model: nn.Module, slots: Sequence[_Slot], *, merge_adapters: bool
) -> tuple[nn.Module, list[_Slot], _lora.ExportView]:
    """The model whose names are exported (a peft model's base when merging) and the
    slots under its unwrapped names; raises before any collective for wrapped
    modules that are not merged, or adapters that cannot be."""
    target, prefix = _lora.base_model(model) if merge_adapters else (model, "")
    view = _lora.export_view(target)
    if view.wrapped and not merge_adapters:
        raise _lora.wrapped_error(target, view.wrapped)
    if merge_adapters and not view.wrapped:
        raise ValueError(
            f"merge_adapters=True, but {type(target).__name__} has no adapter-wrapped modules "
            "to merge; leave the option out"
        )
    cut = f"{prefix}." if prefix else ""
    renamed: list[_Slot] = []
    for slot in slots:
        inner = [n[len(cut) :] for n in slot.names if n.startswith(cut)]
        names = tuple(dict.fromkeys(view.names[n] for n in inner if n in view.names))
        if names:
            renamed.append(_Slot(names, slot.tensor))
    return target, renamed, view


def _export_keys(
    model: nn.Module,
    slots: Sequence[_Slot],
    key_mapping: KeyMapping | None,
    *,
    merge_adapters: bool = False,
) -> _Export:
    target, slots, view = _unwrapped_slots(model, slots, merge_adapters=merge_adapters)
    if key_mapping is not None:
        entries = [(key_mapping(slot.names[0]), slot) for slot in slots]
    elif _hf_model.is_hf_model(target):
        table = _hf_names(target, slots)
        entries = [(table[s.names[0]], s) for s in slots if s.names[0] in table]
    else:
        entries = [(slot.names[0], slot) for slot in slots]
    terms: dict[str, tuple[_lora.Term, ...]] = {}
    for key, slot in entries:
        found = [view.terms[n] for n in slot.names if n in view.terms]
        if found:
            terms[key] = found[0]
    lost = sorted(set(view.terms) - {n for _, s in entries for n in s.names})
    if lost:
        raise ValueError(
            f"the merged tensors {_listed(lost)} would not be saved (the model's "
            "save_pretrained drops them); no export was written"
        )
    return _Export(_unique(entries), terms, target)


def _unique(entries: list[tuple[str, _Slot]]) -> list[tuple[str, _Slot]]:
    counts = Counter(key for key, _ in entries)
    twice = [key for key, count in counts.items() if count > 1]
    if twice:
        raise ValueError(f"several model tensors would be saved as {_listed(twice)}")
    return entries


def save_pretrained(
    model: nn.Module,
    directory: PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    key_mapping: KeyMapping | None = None,
    merge_adapters: bool = False,
    timeout: float | timedelta | None = None,
) -> tuple[str, ...]:
    """Write ``model`` (sharded or not) as a directory ``from_pretrained`` loads; the files.

    Call it on every rank. Sharded parameters are gathered tensor by tensor and
    rank 0 writes them in the model's dtypes, in files of at most
    ``max_shard_size`` (bytes, or e.g. ``"5GB"``; a bigger tensor gets a file of
    its own) with an index when there are several, replacing an earlier export
    in ``directory``. Names are those the model's own ``save_pretrained`` writes
    for transformers models (tied aliases once), else the module names, unless
    ``key_mapping`` (module name -> checkpoint key) says otherwise. A config with
    ``save_pretrained`` is written too (with the class and the dtype holding most
    parameters). Rank 0 holds one output file of full tensors at a time; every
    rank briefly holds one full tensor while it is gathered.

    Collective, and safe for the export it replaces: every rank of the model's
    mesh must call it (it waits at most ``timeout``, seconds or a timedelta,
    default the process group's timeout, then raises ``CollectiveCallError``
    naming the ranks that did not arrive); every precondition (options, meta
    tensors, names, a writable destination with room) is agreed before the
    first gather, and a failure on any rank is raised on every rank. Rank 0
    writes the new export into a temporary sibling of ``directory``, reads it
    back and swaps it in, so ``directory`` always holds the complete old export
    or the complete new one; the user's other files there are kept.

    LoRA (peft): a ``PeftModel`` is exported as its active adapter alone, in
    peft's format (``adapter_config.json``, ``adapter_model.safetensors``), which
    ``PeftModel.from_pretrained(base, directory)`` loads; only adapter tensors
    are gathered. With ``merge_adapters=True`` a ``PeftModel`` (or its
    ``get_base_model()``) is exported merged instead: each LoRA layer's base
    weight plus ``scaling * B @ A``, under the base model's names and with its
    config, computed on the gathered tensors (the model is not changed). A
    model with adapter-wrapped modules is never saved under wrapped names: without
    ``merge_adapters`` that fails on every rank before anything is written, as
    do adapters the merge does not implement (DoRA and other variants, LoRA on
    embeddings or convolutions).
    """
    ranks = group_ranks(model=model)
    with enter_collective("save_pretrained", ranks=ranks, timeout=timeout) as call:
        plan = call.run(
            lambda: _plan_export(model, max_shard_size, key_mapping, merge_adapters),
            step="checking the model and the options",
        )
        if plan is None:  # a PeftModel: its adapter alone, in peft's format
            return _export_adapter(model, directory, None, "auto", call)
        with _beside(call, directory, plan.total_size, replaces=is_weight_file) as work:
            written = _write_export(model, plan, work, call)
    logger.info("saved %d tensors to %s in %d files", len(plan.entries), directory, len(plan.files))
    return written


@dataclass(frozen=True)
class _ExportPlan:
    """What every rank gathers and rank 0 writes, decided before the first gather."""

    export: Any
    entries: list[tuple[str, _Slot]]
    files: list[str]
    groups: list[list[str]]
    total_size: int
    slots: list[_Slot]


def _plan_export(
    model: nn.Module,
    max_shard_size: int | str,
    key_mapping: KeyMapping | None,
    merge_adapters: bool,
) -> _ExportPlan | None:
    """Every precondition of an export checked on this rank (``None``: a peft adapter)."""
    require_safetensors()
    check_unchanged_since_sharding(model, where="save_pretrained")
    limit = parse_size(max_shard_size, argument="max_shard_size")
    if key_mapping is not None and not callable(key_mapping):
        raise TypeError(
            f"key_mapping must be a function of a module name, got {type(key_mapping).__name__}"
        )
    if not isinstance(merge_adapters, bool):
        raise TypeError(f"merge_adapters must be a bool, got {merge_adapters!r}")
    if _lora.is_peft_model(model) and not merge_adapters:
        if key_mapping is not None:
            raise ValueError(
                "key_mapping= does not apply to the adapter export of a PeftModel (peft names "
                "its keys); pass merge_adapters=True to export merged weights under new names"
            )
        return None
    _reshard(model)
    slots = _persistent_slots(model)
    if any(_is_meta(slot.tensor) for slot in slots):
        raise ValueError("the model still has tensors on the meta device: load or fill it first")
    export = _export_keys(model, slots, key_mapping, merge_adapters=merge_adapters)
    entries = export.entries
    sizes = [(key, slot.tensor.numel() * slot.tensor.element_size()) for key, slot in entries]
    groups = plan_files(sizes, limit)
    return _ExportPlan(
        export=export,
        entries=entries,
        files=file_names(len(groups)),
        groups=groups,
        total_size=sum(size for _, size in sizes),
        slots=slots,
    )


def _write_export(
    model: nn.Module, plan: _ExportPlan, work: Path | None, call: CollectiveCall
) -> tuple[str, ...]:
    """Gather file by file; rank 0 (``work`` set) writes each file, then the index and
    configs, and reads the export back. The ranks agree after each file."""
    slot_of = dict(plan.entries)
    weight_map: dict[str, str] = {}
    for name, keys in zip(plan.files, plan.groups, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for key in keys:
            value = _gathered(slot_of[key], plan.export.terms.get(key, ()), keep=work is not None)
            if value is not None:
                tensors[key] = value.contiguous()
        if work is not None:
            weight_map.update(dict.fromkeys(keys, name))

        def write(name: str = name, tensors: dict[str, torch.Tensor] = tensors) -> None:
            if work is not None:
                write_file(work / name, tensors)

        call.run(write, step=f"writing {name}")
        del tensors
    written = list(plan.files)
    if len(plan.files) > 1:
        written.append("model.safetensors.index.json")

    def finish() -> list[str]:
        if work is None:
            return []
        if len(plan.files) > 1:
            write_index(work, weight_map, plan.total_size)
        floating = (s.tensor for s in plan.slots if s.tensor.dtype.is_floating_point)
        configs = _hf_model.write_configs(
            plan.export.config_model, work, dtype=dominant_dtype(floating)
        )
        verify_export(work, weight_map)
        return configs

    configs = call.run(finish, step="writing the index and configs and reading them back")
    return tuple(written + configs)


def export_adapter(
    model: nn.Module,
    directory: PathLike,
    *,
    adapter: str | None = None,
    save_embedding_layers: bool | str = "auto",
    timeout: float | timedelta | None = None,
) -> tuple[str, ...]:
    """Write one adapter of a (sharded) peft model as peft does; the files. Collective.

    ``adapter`` defaults to the active one. The keys and ``adapter_config.json``
    are what peft's own ``save_pretrained`` writes for it (run on markers, in a
    temporary directory on every rank); only the tensors it names are gathered.
    Written beside the old files and swapped in as ``save_pretrained`` does; only
    adapter files of ``directory`` are replaced. peft's model card
    (``README.md``) is not written.
    """
    ranks = group_ranks(model=model)
    with enter_collective("save_pretrained", ranks=ranks, timeout=timeout) as call:
        return _export_adapter(model, directory, adapter, save_embedding_layers, call)


@dataclass(frozen=True)
class _AdapterPlan:
    adapter: str
    entries: list[tuple[str, _Slot]]  # sorted by key
    config: bytes  # adapter_config.json as peft writes it
    total_size: int


def _plan_adapter(
    model: nn.Module, adapter: str | None, save_embedding_layers: bool | str
) -> _AdapterPlan:
    """The adapter's keys and config, checked on this rank before any gather."""
    require_safetensors()
    check_unchanged_since_sharding(model, where="save_pretrained")
    name = _lora.active_adapter(model) if adapter is None else adapter
    if name not in _lora.adapter_names(model):
        raise ValueError(
            f"adapter {name!r} is not one of the model's adapters "
            f"{list(_lora.adapter_names(model))}"
        )
    _reshard(model)
    slots = _persistent_slots(model)
    table, extra = _hf_model.adapter_checkpoint(
        model,
        [slot.names for slot in slots],
        adapter=name,
        save_embedding_layers=save_embedding_layers,
    )
    found: list[tuple[str, _Slot]] = []
    for slot in slots:
        alias = next((n for n in slot.names if n in table), None)
        if alias is not None:
            found.append((table[alias], slot))
    entries = sorted(_unique(found), key=lambda entry: entry[0])
    if any(_is_meta(slot.tensor) for _, slot in entries):
        raise ValueError("the model still has tensors on the meta device: load or fill it first")
    sizes = sum(slot.tensor.numel() * slot.tensor.element_size() for _, slot in entries)
    return _AdapterPlan(name, entries, extra[_hf_model.ADAPTER_CONFIG], sizes)


def _verify_adapter(work: Path, keys: Sequence[str]) -> None:
    """Read the written adapter back: the same keys, a config."""
    path = work / _hf_model.ADAPTER_WEIGHTS
    with open_file(path) as handle:
        if sorted(handle.keys()) != sorted(keys):
            raise OSError(errno.EIO, "the written adapter holds other keys", str(path))
    if not (work / _hf_model.ADAPTER_CONFIG).is_file():
        raise OSError(errno.EIO, "the adapter config was not written", str(work))


@contextmanager
def _beside(
    call: CollectiveCall, directory: PathLike, total_size: int, *, replaces: Callable[[str], bool]
) -> Iterator[Path | None]:
    """A directory beside ``directory`` to write into (on the writing rank; ``None`` on the
    others); when the block ends well it is swapped in (replacing only the files
    ``replaces`` accepts), else discarded, so ``directory`` keeps its old export."""
    main = call.rank == (call.ranks[0] if call.active else call.rank)
    root = _export_swap.destination(directory)
    work = call.run(
        lambda: _export_swap.prepare(root, total_size) if main else None,
        step=f"preparing a directory beside {str(root)!r}",
    )
    try:
        yield work
        call.run(
            lambda: (
                _export_swap.swap_in(work, root, replaces=replaces) if work is not None else None
            ),
            step=f"replacing the export in {str(root)!r}",
        )
    except BaseException:
        if work is not None and work.exists():
            _export_swap.discard(work)
        raise


def _export_adapter(
    model: nn.Module,
    directory: PathLike,
    adapter: str | None,
    save_embedding_layers: bool | str,
    call: CollectiveCall,
) -> tuple[str, ...]:
    """The adapter export inside an entered collective call (same write path as models)."""
    plan = call.run(
        lambda: _plan_adapter(model, adapter, save_embedding_layers),
        step="deriving the adapter's keys",
    )
    with _beside(
        call, directory, plan.total_size, replaces=_hf_model.ADAPTER_FILES.__contains__
    ) as work:
        tensors: dict[str, torch.Tensor] = {}
        for key, slot in plan.entries:
            value = _full(slot.tensor, keep=work is not None)
            if value is not None:
                tensors[key] = value.contiguous()

        def write() -> None:
            if work is not None:
                write_file(work / _hf_model.ADAPTER_WEIGHTS, tensors)
                (work / _hf_model.ADAPTER_CONFIG).write_bytes(plan.config)
                _verify_adapter(work, [key for key, _ in plan.entries])

        call.run(write, step=f"writing {_hf_model.ADAPTER_WEIGHTS} and reading it back")
        tensors.clear()
    logger.info("saved adapter %r (%d tensors) to %s", plan.adapter, len(plan.entries), directory)
    return (_hf_model.ADAPTER_WEIGHTS, _hf_model.ADAPTER_CONFIG)
