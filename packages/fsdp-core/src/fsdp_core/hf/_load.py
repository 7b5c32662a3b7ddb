"""``load_pretrained``: a Hugging Face checkpoint directory into a (sharded) model.

The implementation behind [`load_pretrained`][fsdp_core.hf.pretrained.load_pretrained];
[fsdp_core.hf.pretrained][] is the public module. Every rank reads only the
slices of its own shards, with no communication beyond agreeing on the layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_core.collective_entry import enter_collective, group_ranks
from fsdp_core.hf import _hf_model, _lora, _lora_load
from fsdp_core.hf import _transformers as tf
from fsdp_core.hf._safetensors_dir import CheckpointLayout, open_file, read_layout
from fsdp_core.hf._shard_read import code_of, copy_full, read_into
from fsdp_core.hf._slots import (
    KeyMapping,
    PathLike,
    Slot,
    check_call,
    hf_names,
    listed,
    persistent_slots,
    renamed,
    reshard,
)
from fsdp_core.weights_check import (
    is_meta,
    mark_weights_loaded,
    non_persistent_buffers,
    sentinel_fill,
    still_sentinel,
)

# The public module's logger: the split into private modules keeps the name users configure.
logger = logging.getLogger("fsdp_core.hf.pretrained")


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


def _default_device(model: nn.Module) -> torch.device:
    """Where ``to_empty`` allocates without ``device=``: the mesh's device, else the CPU."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            kind = param.device_mesh.device_type
            if kind == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(kind)
    return torch.device("cpu")


@dataclass(frozen=True)
class _Match:
    """One way of naming the model's tensors, tried against the checkpoint's keys."""

    naming: str
    keys: dict[str, str]  # every module name of a matched tensor -> its checkpoint key
    matched: int
    missing: tuple[str, ...]
    expected: tuple[str, ...]
    unexpected: tuple[str, ...]

    @property
    def problems(self) -> int:
        return len(self.missing) + len(self.unexpected)


def _match(naming: str, slots: Sequence[Slot], keys: Iterable[str], rename: KeyMapping) -> _Match:
    """Each slot's key under ``rename`` (any alias may match: tied tensors are saved once)."""
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


def _declined(model: nn.Module, keys: Iterable[str]) -> set[str]:
    """Checkpoint keys the model has no use for by design: a non-persistent buffer's (an
    old saved ``inv_freq``), and transformers' ``_keys_to_ignore_on_load_unexpected``."""
    leaves = {name.rpartition(".")[2] for name in non_persistent_buffers(model)}
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
    model: nn.Module, slots: Sequence[Slot], keys: Iterable[str], key_mapping: KeyMapping | None
) -> _Match:
    """The caller's naming, else the module names, else those ``save_pretrained`` writes."""
    keys = list(keys)
    if key_mapping is not None:
        return _match("key_mapping", slots, keys, key_mapping)
    same = _match("module", slots, keys, lambda name: name)
    if same.problems == 0 or not _hf_model.is_hf_model(model):
        return same
    table = hf_names(model, slots)  # neither fits: report against the names transformers writes
    return _match("save_pretrained", slots, keys, lambda name: table.get(name, name))


def _load_tensors(layout: CheckpointLayout, slots: Sequence[Slot], match: _Match) -> list[str]:
    """Read every matched slot, file by file; the names whose dtype was cast."""
    by_file: dict[str, list[tuple[str, Slot]]] = {}
    for slot in slots:
        key = match.keys.get(slot.names[0])
        if key is not None:
            by_file.setdefault(layout.weight_map[key], []).append((key, slot))
    cast: list[str] = []
    for file in sorted(by_file):
        with open_file(layout.directory / file) as handle:
            for key, slot in by_file[file]:
                if read_into(handle, key, slot) != code_of(slot.tensor.dtype):
                    cast.extend(slot.names)
    return cast


def _retie(model: nn.Module, slots: Sequence[Slot]) -> None:
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


def _fill_buffers(
    model: nn.Module,
    was_meta: set[str],
    kept: Mapping[str, torch.Tensor],
    given: Mapping[str, torch.Tensor],
) -> list[str]:
    """Give non-persistent buffers their values after ``to_empty``; the recomputed names."""
    buffers = non_persistent_buffers(model)
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
            f"non-persistent buffers {listed(undefined)} were on the meta device, are not in "
            "any checkpoint and nothing recomputed them: pass buffers={name: tensor}"
        )
    return recomputed


def _check_buffer_names(model: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """A misspelt ``buffers=`` name fails instead of leaving the buffer undefined."""
    known = {name for name, _ in model.named_buffers()}
    unknown = [name for name in buffers if name not in known]
    if unknown:
        raise ValueError(f"buffers= names {listed(unknown)}, which are not buffers of the model")


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

    Call it on every rank after sharding a model built on ``meta``: it allocates the
    model (``to_empty``) on ``device`` (default: the mesh's device, else the CPU), reads
    each rank's slices and casts every tensor to the dtype the model holds.

    Checkpoint keys are matched to module names as they are, else (transformers models)
    as the model's own ``save_pretrained`` writes them; ``key_mapping`` (module name ->
    checkpoint key) overrides both. Tied parameters are read once. Non-persistent
    buffers are recomputed by transformers models' buffer initialisation; give others
    in ``buffers``. With ``strict`` missing or unexpected tensors fail, named; otherwise
    they are returned. Keys the model declines on purpose (an old saved ``inv_freq``,
    ``_keys_to_ignore_on_load_unexpected``) are skipped and listed as ``ignored``.

    LoRA (peft): a ``PeftModel`` reads its base weights under their unwrapped names.
    When the load allocates the model, the adapters get peft's initial values
    (``init_lora_weights=True`` or ``"gaussian"``; others are refused before any read),
    drawn from the default CPU generator: seed every rank alike right before the load.
    A directory holding an adapter export (``adapter_config.json``,
    ``adapter_model.safetensors``) loads the active adapter into a ``PeftModel`` whose
    base weights are loaded. On a pipeline stage the other stages' keys are returned as
    ``unexpected`` and do not fail ``strict``.

    Collective: every rank of the model's mesh must call it; it waits at most
    ``timeout`` for the others, checks that every rank sees the same checkpoint layout
    and raises a failure of any rank on every rank.

    Args:
        model: the model (built on ``meta`` and sharded, or a plain one).
        directory: a ``save_pretrained`` directory (or an adapter export).
        key_mapping: module name -> checkpoint key, instead of the automatic naming.
        buffers: values for non-persistent buffers the model cannot recompute.
        device: where a ``meta`` model is allocated.
        strict: fail on missing or unexpected keys (else report them).
        timeout: the arrival check's timeout in seconds or a timedelta.

    Returns:
        How names were matched, and the keys missing, unexpected or ignored.

    Raises:
        CollectiveCallError: a rank did not arrive or failed (on every rank).
    """
    ranks = group_ranks(model=model)
    stage = dist.is_initialized() and len(ranks) < dist.get_world_size()
    with enter_collective("load_pretrained", ranks=ranks, timeout=timeout) as call:
        layout = call.run(
            lambda: _read_load_layout(directory),
            step=f"reading the layout of {str(directory)!r}",
        )
        call.agree_on(_layout_fingerprint(layout), what=f"checkpoint layout of {str(directory)!r}")
        return call.run(
            lambda: _load(model, directory, layout, key_mapping, buffers, device, strict, stage),
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


def _load_adapter(
    model: nn.Module, directory: PathLike, layout: CheckpointLayout, strict: bool, stage: bool
) -> PretrainedLoad:
    """An adapter export into a loaded peft model (``stage``: other stages' keys are fine)."""
    if not _lora.is_peft_model(model):
        raise ValueError(
            f"{str(directory)!r} holds an adapter export (adapter_config.json, "
            f"{_hf_model.ADAPTER_WEIGHTS}); it loads into the PeftModel, not into "
            f"{type(model).__name__}"
        )
    reshard(model)
    slots = persistent_slots(model)
    if any(is_meta(slot.tensor) for slot in slots):
        raise ValueError(
            f"{str(directory)!r} holds an adapter export, but the model still has tensors on "
            "the meta device: load the base checkpoint first (load_pretrained(peft_model, "
            "base_dir)), then the adapter export"
        )
    adapter = _lora.active_adapter(model)
    table, _ = _hf_model.adapter_checkpoint(model, [slot.names for slot in slots], adapter=adapter)
    wanted = [slot for slot in slots if any(name in table for name in slot.names)]
    match = _match("adapter", wanted, layout.weight_map, lambda name: table.get(name, name))
    if match.missing or (match.unexpected and not stage):
        message = (
            f"adapter export {str(directory)!r} does not match adapter {adapter!r} of "
            f"{type(model).__name__}: {len(match.missing)} adapter tensors missing "
            f"{listed(match.missing)}, {len(match.unexpected)} unexpected keys "
            f"{listed(match.unexpected)}"
        )
        if strict:
            raise ValueError(message + "; was it saved from a model with the same LoraConfig?")
        logger.warning("%s", message)
    cast = _load_tensors(layout, wanted, match)
    logger.info("loaded adapter %r (%d tensors) from %s", adapter, match.matched, directory)
    return _result(directory, layout, match, cast)


def _result(
    directory: PathLike,
    layout: CheckpointLayout,
    match: _Match,
    cast: Sequence[str],
    recomputed: Sequence[str] = (),
    ignored: tuple[str, ...] = (),
) -> PretrainedLoad:
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


def _layout_fingerprint(layout: CheckpointLayout) -> str:
    """A short digest of the key -> file map, for the ranks to agree on one checkpoint."""
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
    stage: bool,
) -> PretrainedLoad:
    """The load on this rank (no collectives), once every rank holds the same layout."""
    check_call(model, "load_pretrained", key_mapping)
    if layout.files == (_hf_model.ADAPTER_WEIGHTS,):  # peft's adapter export
        if key_mapping is not None or buffers:
            raise ValueError(
                "key_mapping= and buffers= do not apply to an adapter export (peft names its keys)"
            )
        return _load_adapter(model, directory, layout, strict, stage)
    given = dict(buffers or {})
    _check_buffer_names(model, given)
    reshard(model)
    slots = persistent_slots(model)
    view = _lora_view(model, slots)
    match, ignored = _match_checkpoint(model, slots, view, layout, key_mapping)
    _report_mismatch(model, directory, match, strict, stage=stage)
    allocated, recomputed = _allocate(model, slots, given, device)
    fresh = persistent_slots(model)
    cast = _load_tensors(layout, fresh if view is None else renamed(fresh, view.names), match)
    if view is not None and allocated:  # adapters that held no values: peft's first ones
        _lora_load.initialise_adapters(model, view.adapters, copy_full)
    mark_weights_loaded(model)  # the reads wrote local shards only (fsdp_core.weights_check)
    logger.info(
        "loaded %d tensors from %s (%d files, names as %s; %d cast to the model's dtype)",
        match.matched,
        directory,
        len(layout.files),
        match.naming,
        len(cast),
    )
    return _result(directory, layout, match, cast, recomputed, ignored)


def _lora_view(model: nn.Module, slots: Sequence[Slot]) -> _lora_load.LoadView | None:
    """A LoRA model's base-model names (``None`` for other models); with a tensor still on
    ``meta`` the adapters need peft's first values: others are refused before any read."""
    if not _lora_load.is_lora_model(model):
        return None
    return _lora_load.load_view(
        model,
        [name for slot in slots for name in slot.names],
        initialise=any(is_meta(slot.tensor) for slot in slots),
    )


def _match_checkpoint(
    model: nn.Module,
    slots: Sequence[Slot],
    view: _lora_load.LoadView | None,
    layout: CheckpointLayout,
    key_mapping: KeyMapping | None,
) -> tuple[_Match, tuple[str, ...]]:
    """Checkpoint keys for the model's tensors, and the declined keys (not ``unexpected``)."""
    if view is None:
        match = _resolve(model, slots, layout.weight_map, key_mapping)
    else:
        match = _resolve(view.target, renamed(slots, view.names), layout.weight_map, key_mapping)
    ignored = tuple(sorted(_declined(model, match.unexpected)))
    if ignored:
        unexpected = tuple(k for k in match.unexpected if k not in ignored)
        match = dataclasses.replace(match, unexpected=unexpected)
        logger.info("ignoring %d checkpoint keys the model declines: %s", len(ignored), ignored)
    return match, ignored


def _report_mismatch(
    model: nn.Module, directory: PathLike, match: _Match, strict: bool, *, stage: bool = False
) -> None:
    """Missing or unexpected tensors: an error under ``strict`` (before anything is read),
    else a warning. On a pipeline stage unexpected keys are the other stages' (logged)."""
    if stage and match.unexpected:
        logger.info(
            "pipeline stage: %d checkpoint keys of other stages not loaded here: %s",
            len(match.unexpected),
            listed(match.unexpected),
        )
        match = dataclasses.replace(match, unexpected=())
    if not match.problems:
        return
    message = (
        f"checkpoint {str(directory)!r} does not match {type(model).__name__} "
        f"(names matched as: {match.naming}): {len(match.missing)} model tensors missing "
        f"{listed(match.missing)}"
        + (f" (looked up as {listed(match.expected)})" if match.expected else "")
        + f", {len(match.unexpected)} unexpected checkpoint keys {listed(match.unexpected)}"
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


def _allocate(
    model: nn.Module,
    slots: Sequence[Slot],
    given: Mapping[str, torch.Tensor],
    device: torch.device | str | None,
) -> tuple[bool, list[str]]:
    """Allocate a ``meta`` model (buffers that held values kept, ties it split restored)
    and fill non-persistent buffers; whether it allocated, and the buffers recomputed."""
    non_persistent = non_persistent_buffers(model)
    was_meta = {name for name, buf in non_persistent.items() if buf.is_meta}
    allocated = any(is_meta(s.tensor) for s in slots) or bool(was_meta)
    if allocated:
        kept = {n: b.detach().clone() for n, b in non_persistent.items() if n not in was_meta}
        model.to_empty(device=device if device is not None else _default_device(model))
        _retie(model, slots)
        was_meta = set(non_persistent)  # to_empty replaced every buffer
    else:
        kept = {}
    return allocated, _fill_buffers(model, was_meta, kept, given)
